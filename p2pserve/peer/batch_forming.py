"""Batch forming: hold a step briefly for the sessions that are due to arrive.

Pure logic; the compute worker asks `ArrivalForecast.hold_s` before each step and waits that
long (or until the next arrival) on its condition variable.

Off by default (``BatchingConfig.max_batch_wait_s`` = 0, ``--batch-wait-ms``): on the shared 2-core
machine it cut steps but not time (docs/kv-cache.md).

Why: a peer's step of 16 decode tokens costs far less than 16 steps of one (a decode step reads
every weight of the span once; in process, SmolLM2's 16-session step took 2.4× a lone one), so
the throughput of many sessions depends on how many of them each step carries. Sessions
driven through a pipeline reach a peer in bursts, one burst per step of the previous hop, spread
over the time the client (or the previous peer) takes to relay them. A worker that starts a
step on the first arrival splits every burst: in a 3-peer SmolLM2 pipeline with 16 sessions,
each peer ran about 5 steps per token round instead of 1 (see docs/kv-cache.md). Waiting for a
session costs latency, not compute, and a step run for the stragglers alone would cost a whole
step's compute; so the worker waits, at most ``horizon`` (about one step's compute time), for
the sessions whose next Forward is due within it.

A session is *due* when its previous Forwards arrived at a steady period: it is expected at
``last arrival + period`` (the period is the mean of its last two inter-arrival gaps). A
session that is overdue by more than the horizon is not waited for (its client stopped, or is
busy elsewhere), nor is a session that has sent only one Forward, nor one that is closed. A lone
session (nothing else due) never waits.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2pserve.types import SessionId


@dataclass
class _Arrivals:
    session: object  # the peer's Session (``closed`` is read)
    last: float  # when its latest Forward arrived (time.monotonic())
    period: float | None = None  # its expected gap between Forwards, once seen


class ArrivalForecast:
    """When each session's next Forward is due, from the times its Forwards arrived."""

    #: Forget a session silent for this many periods (or `_STALE_S` before it has one).
    _STALE_PERIODS = 8
    _STALE_S = 60.0

    def __init__(self) -> None:
        self._sessions: dict[str, _Arrivals] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def arrived(self, session_id: SessionId, session: object, now: float) -> None:
        """A Forward of ``session`` arrived at ``now``."""
        seen = self._sessions.get(session_id)
        if seen is None or seen.session is not session:
            self._sessions[session_id] = _Arrivals(session, now)
            return
        gap = now - seen.last
        seen.period = gap if seen.period is None else (seen.period + gap) / 2
        seen.last = now

    def hold_s(self, waiting: set[str], ready_at: float, now: float, horizon: float) -> float:
        """Seconds to hold the next step (0: run it now): while some session not in ``waiting``
        is due by ``ready_at + horizon`` and not overdue by more than ``horizon``, hold until
        ``ready_at + horizon`` (the caller re-asks at each arrival)."""
        deadline = ready_at + horizon
        due = False
        for sid, seen in list(self._sessions.items()):  # every step: closed and silent ones leave
            if getattr(seen.session, "closed", False) or self._stale(seen, now):
                del self._sessions[sid]
                continue
            if due or horizon <= 0 or sid in waiting or seen.period is None:
                continue
            expected = seen.last + seen.period
            due = expected <= deadline and expected + horizon >= now
        return deadline - now if due and now < deadline else 0.0

    def active(self, now: float) -> int:
        """Sessions seen recently and still open (gLLM's running decode count, #RD, at this peer)."""
        return sum(1 for seen in self._sessions.values()
                   if not getattr(seen.session, "closed", False) and not self._stale(seen, now))

    def _stale(self, seen: _Arrivals, now: float) -> bool:
        limit = self._STALE_S if seen.period is None else max(self._STALE_PERIODS * seen.period, 1.0)
        return now - seen.last > limit
