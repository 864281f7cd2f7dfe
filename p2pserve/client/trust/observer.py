"""What a client observes of the peers it uses, published as signed ``ServiceReports``.

The pipeline tells a :class:`ServiceObserver` two things per hop: the round trip of the
OpenSession (no compute: the link's RTT, :meth:`ServiceObserver.rtt`) and the round trip of
every one-token decode Forward (:meth:`ServiceObserver.decode`). Per peer it keeps the last
``window`` decode round trips at one layer count (a new span starts a new window) and reports
``wall_rate`` = 1 / median round trip and ``rate`` = 1 / (median round trip - the smallest RTT
seen): one session's tokens/s, with and without the wire (``p2pserve/dht/reports.py``).
Prefill steps are not observed: claims the planner uses are decode rates.

:class:`ReportPublisher` announces the observer's record every ``ClientConfig.report_period_s``.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from p2pserve import clock as clocks
from p2pserve.clock import Clock
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.reports import MAX_REPORTED_PEERS, ObservedRate, ServiceReports
from p2pserve.types import PeerId

log = logging.getLogger(__name__)

MIN_SERVICE_S = 1e-6  # a round trip no longer than the RTT reads as this much service


@dataclass
class _PeerWindow:
    layers: int
    round_trips: deque = field(default_factory=deque)
    rtt: float = float("inf")  # smallest OpenSession round trip seen
    last_at: float = 0.0


class ServiceObserver:
    """Per-peer decode round trips of one client (``clock``: DHT time, for ``observed_at``)."""

    def __init__(self, window: int = 64, max_age_s: float = 600.0, clock: Clock = clocks.wall):
        self.window = window
        self.max_age_s = max_age_s
        self._clock = clock
        self._peers: dict[str, _PeerWindow] = {}
        self._receipts: dict[str, bytes] = {}  # peer id -> its latest receipt for us

    def _of(self, peer_id: PeerId, layers: int) -> _PeerWindow:
        w = self._peers.get(peer_id)
        if w is None or w.layers != layers:
            rtt = w.rtt if w is not None else float("inf")
            w = self._peers[peer_id] = _PeerWindow(layers, deque(maxlen=self.window), rtt)
        return w

    def rtt(self, peer_id: PeerId, layers: int, seconds: float) -> None:
        """An OpenSession round trip to ``peer_id`` (opened for ``layers`` layers)."""
        w = self._of(peer_id, layers)
        w.rtt = min(w.rtt, seconds)

    def receipt(self, peer_id: PeerId, receipt: bytes) -> None:
        """The service receipt ``peer_id`` gave us (``dht/receipts.py``): what makes our reports
        on it count. The coordinator checks it; a peer that gave none is reported without one."""
        self._receipts[peer_id] = receipt

    def decode(self, peer_id: PeerId, layers: int, seconds: float) -> None:
        """A one-token Forward round trip to ``peer_id`` serving ``layers`` layers for us."""
        w = self._of(peer_id, layers)
        w.round_trips.append(seconds)
        w.last_at = self._clock()

    def rates(self) -> list[ObservedRate]:
        """What to report now: peers with samples in the last ``max_age_s``, newest first."""
        now = self._clock()
        for pid in [p for p, w in self._peers.items() if w.last_at and now - w.last_at > self.max_age_s]:
            del self._peers[pid]
            self._receipts.pop(pid, None)
        out = []
        for pid, w in self._peers.items():
            if not w.round_trips:
                continue
            rt = statistics.median(w.round_trips)
            rtt = w.rtt if w.rtt < float("inf") else 0.0
            wall = 1.0 / max(rt, MIN_SERVICE_S)
            rate = 1.0 / max(rt - rtt, MIN_SERVICE_S)
            out.append(ObservedRate(peer_id=pid, layers=w.layers, samples=len(w.round_trips),
                                    rate=max(rate, wall), wall_rate=wall, observed_at=w.last_at,
                                    receipt=self._receipts.get(pid, b"")))
        out.sort(key=lambda r: -r.observed_at)
        return out[:MAX_REPORTED_PEERS]

    def report(self, reporter_id: str, model: str, addrs: list[str]) -> Optional[ServiceReports]:
        """The record to publish, or ``None`` while nothing was observed."""
        rates = [r for r in self.rates() if r.peer_id != reporter_id]
        if not rates:
            return None
        return ServiceReports(model=model, reporter_id=reporter_id, addrs=addrs[:32], rates=rates,
                              timestamp=self._clock())


class ReportPublisher:
    """Announces ``observer``'s record through ``swarm`` every ``period`` seconds."""

    def __init__(self, swarm, observer: ServiceObserver, period: float):
        self.swarm = swarm
        self.observer = observer
        self.period = period

    async def publish(self) -> bool:
        """Announce the current report (if any) once; returns whether one was stored."""
        cfg = self.swarm.config
        addrs = getattr(self.swarm, "visible_maddrs", list)()  # a client-mode node may listen nowhere
        rep = self.observer.report(self.swarm.peer_id, cfg.model, list(addrs))
        if rep is None:
            return False
        return await self.swarm.announce(RecordKind.REPORTS, rep, ttl=max(2.0 * self.period, cfg.max_clock_skew))

    async def run(self) -> None:
        """Publish every period until cancelled; one failed announcement is logged and skipped."""
        while True:
            await asyncio.sleep(self.period)
            try:
                await self.publish()
            except (asyncio.TimeoutError, OSError) as e:
                log.info(f"service report not published ({e!r}); next period")
            except Exception:  # a reporting hiccup must never end the client
                log.exception("service report failed; next period")
