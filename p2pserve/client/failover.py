"""Failover decisions, pure: whom to ban and for how long, what is worth retrying, what to say.

The :class:`~p2pserve.client.pipeline.Pipeline` applies them when a hop fails (connection lost,
timeout, a typed error such as "overloaded" or "range moved"):

1. the failing hop's peer is banned for a while, with exponential backoff per repeat offence
   (``ClientConfig.ban_base_s`` doubling up to ``ban_max_s``); "overloaded" is a short,
   non-escalating mask instead, since the peer is healthy, just full; "range moved" bans no one:
   the peer is healthy and our view of the swarm is stale, so the route provider is told to
   re-read the plan and the client pauses ``ClientConfig.stale_route_pause_s`` for the peer's new
   announcement to land;
2. the route provider builds a new route over what remains (IWRR over the plan, or known peers);
3. the new route receives the whole token history plus the pending tokens as one prefill.
   Peers sample with a seed per absolute position, so the token that comes back is the one the
   failed route would have produced: greedy and seeded sampling both stay token-identical.

Failures are counted per step (a successful step resets the count) and bounded by
``ClientConfig.max_retries``; then ``GenerationFailedError`` lists every hop that failed and why.
When no usable route is left, a request may wait (``ClientConfig.no_route_wait_s``,
:func:`route_pause`) for the swarm to offer one again before it fails.
A client-side mistake (remote ``BadRequestError``) is not retried: it would fail anywhere.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from p2pserve.client.hop import Hop
from p2pserve.client.routing import Masks
from p2pserve.clock import Clock, monotonic
from p2pserve.config import ClientConfig
from p2pserve.errors import (
    AllRoutesOverloadedError,
    BadRequestError,
    GenerationFailedError,
    NoRouteError,
    OverloadedError,
    RangeMovedError,
    RoutingError,
    SilentRingError,
    is_next_hop_unreachable,
)


class HopFailure(Exception):
    """A call to one hop failed; carries the hop and the original exception."""

    def __init__(self, hop: Hop, cause: BaseException):
        super().__init__(f"{hop}: {describe(cause)}")
        self.hop = hop
        self.cause = cause


def describe(exc: BaseException) -> str:
    """A one-line description of an exception (timeouts have empty messages)."""
    text = str(exc)
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)) and not text:
        return "timed out"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class BanList:
    """Peers banned until some time; each repeat offence doubles the ban (capped).

    ``escalate=False`` gives every offence the base duration (used for "overloaded").
    """

    def __init__(self, base_s: float, max_s: float, clock: Clock = monotonic, escalate: bool = True):
        self.base_s = base_s
        self.max_s = max_s
        self.clock = clock
        self.escalate = escalate
        self.strikes: dict[str, int] = {}
        self.until: dict[str, float] = {}

    def ban(self, peer: str) -> float:
        """Ban ``peer`` now; returns the ban's duration in seconds."""
        self._forget_old(self.clock())
        n = self.strikes.get(peer, 0) + 1
        self.strikes[peer] = n
        duration = min(self.base_s * (2 ** (n - 1) if self.escalate else 1), self.max_s)
        self.until[peer] = max(self.until.get(peer, 0.0), self.clock() + duration)
        return duration

    def active(self) -> frozenset[str]:
        """Peers banned at this moment."""
        now = self.clock()
        self._forget_old(now)
        return frozenset(p for p, t in self.until.items() if t > now)

    def _forget_old(self, now: float) -> None:
        """Forget peers whose last ban ended over ``max_s`` ago, strikes included: a peer that
        behaved that long starts afresh, and a long-lived client does not keep every peer id
        it ever banned."""
        for peer in [p for p, t in self.until.items() if t + self.max_s <= now]:
            del self.until[peer]
            self.strikes.pop(peer, None)


@dataclass(frozen=True)
class FailureRecord:
    """One failed hop: which, why, and what the client did about it."""

    hop: Hop
    reason: str
    action: str  # e.g. "banned 5s", "masked as overloaded 5s", "not retried"

    def __str__(self) -> str:
        addr = f" at {self.hop.maddrs[0]}" if self.hop.maddrs else ""
        return f"{self.hop.peer_id}[{self.hop.start}:{self.hop.end}){addr}: {self.reason} ({self.action})"


def is_retriable(exc: BaseException) -> bool:
    """Whether another route may succeed where this hop failed.

    A remote ``BadRequestError`` means our request is wrong (bad parameters, too long): every
    peer would refuse it. Everything else — lost connections, timeouts, overload, a moved
    range, a peer that forgot the session, garbage on the wire — is the peer's problem.
    """
    return not isinstance(exc, BadRequestError)


def failure_message(failures: Sequence[FailureRecord], attempts: int, last: Optional[BaseException] = None) -> str:
    """The text of the final error: every failed hop, in order, then the last straw."""
    lines = [f"generation failed after {attempts} attempt(s); failed hops:"]
    lines += [f"  - {f}" for f in failures] or ["  (none)"]
    if last is not None:
        lines.append(f"  then: {describe(last)}")
    return "\n".join(lines)


def next_move(exc: BaseException, attempts: int, max_retries: int) -> str:
    """What to do after a hop failed on the ``attempts``-th try of one step.

    "raise": our request is wrong, re-raise it; "give up": the retry bound is spent; "re-read":
    the route is stale (re-read the swarm, then re-route); "re-route": route around the peer.
    """
    if not is_retriable(exc):
        return "raise"
    if attempts > max_retries:
        return "give up"
    return "re-read" if isinstance(exc, RangeMovedError) else "re-route"


def route_pause(exc: RoutingError, waited_s: float, wait_s: float) -> Optional[float]:
    """Seconds to pause before re-reading the swarm for a route after ``exc``, or None to give up.

    A request waits at most ``wait_s`` in all (``ClientConfig.no_route_wait_s``), in pauses that
    double from 0.25 s up to 2 s. Every route being overloaded is not waited for: that is load
    (HTTP 429), which waiting here would only hide.
    """
    if (isinstance(exc, NoRouteError) and exc.overloaded) or waited_s >= wait_s:
        return None
    pause = 0.25
    while pause < 2.0 and pause <= waited_s:
        pause *= 2
    return min(pause, 2.0, wait_s - waited_s)


def routes_exhausted(exc: RoutingError, failures: Sequence[FailureRecord], attempts: int) -> GenerationFailedError:
    """The error to raise when hops failed and then no route was left (``exc`` says why).

    ``AllRoutesOverloadedError`` (HTTP 429) when only load blocks the routes left, else
    ``GenerationFailedError`` (503); both list every failed hop. (Before any failure the
    swarm simply has no route, and the ``RoutingError`` itself is what the caller gets.)
    """
    cls = AllRoutesOverloadedError if isinstance(exc, NoRouteError) and exc.overloaded else GenerationFailedError
    return cls(failure_message(failures, attempts, exc))


#: Links a pipeline sets aside as unreachable peer to peer before such a report counts as a
#: failure of the hop it names (each one costs a route and a replay of the history).
MAX_UNLINKS = 4


def no_hop_at_fault(exc: BaseException) -> bool:
    """Whether a failed push names no hop the client can blame: a hop reports its next hop
    unreachable peer to peer, or a ring went silent (any of its hops may be the silent one)."""
    return is_next_hop_unreachable(exc) or isinstance(exc, SilentRingError)


@dataclass
class FailoverState:
    """Bans and failure log of one client, shared by its pipelines (a client learns once)."""

    config: ClientConfig = field(default_factory=ClientConfig)
    clock: Clock = monotonic

    def __post_init__(self) -> None:
        self.bans = BanList(self.config.ban_base_s, self.config.ban_max_s, self.clock)
        self.overloaded = BanList(self.config.ban_base_s, self.config.ban_max_s, self.clock, escalate=False)
        # links between two peers that a push or ring could not cross ("a>b"): routes over them
        # are driven by the client for a while; neither peer is banned for it
        self.unlinked = BanList(self.config.ban_base_s, self.config.ban_max_s, self.clock)

    def masks(self) -> Masks:
        """Masks for the next route."""
        return Masks(banned=self.bans.active(), overloaded=self.overloaded.active())

    def unlink(self, peer_ids: list[str], receiver: str) -> tuple[str, float]:
        """``receiver``'s predecessor in the route ``peer_ids`` (the last hop for the first: a
        ring's closing link) reported it unreachable: routes over that link are driven by the
        client for the returned seconds (its own dial then finds a dead ``receiver``, as
        ``receiver``'s own failure). Returns (that predecessor, seconds)."""
        sender = peer_ids[peer_ids.index(receiver) - 1] if receiver in peer_ids else receiver
        return sender, self.unlinked.ban(f"{sender}>{receiver}")

    def unlink_ring(self, peer_ids: list[str]) -> float:
        """A ring over ``peer_ids`` went silent, at a hop the client cannot tell: every link of it
        (the last hop's to the first included) is set aside, so its routes are driven and the
        client's own call finds the silent hop. Returns the seconds."""
        return max(self.unlinked.ban(f"{a}>{b}") for a, b in zip(peer_ids, peer_ids[1:] + peer_ids[:1]))

    def set_aside(self, peer_ids: list[str], failure: HopFailure) -> str:
        """A push over the route ``peer_ids`` failed at no hop the client can blame
        (:func:`no_hop_at_fault`): set aside the link it names (a silent ring: every link), and
        say so (for the log)."""
        if isinstance(failure.cause, SilentRingError):
            return f"{failure.cause}: its routes are driven for {self.unlink_ring(peer_ids):g}s"
        sender, seconds = self.unlink(peer_ids, failure.hop.peer_id)
        return f"{sender} could not reach {failure.hop.peer_id} peer to peer: that link's routes are driven for {seconds:g}s"

    def unlinked_in(self, hops: Iterable[Hop]) -> bool:
        """Whether a route over ``hops`` (in order, and the last back to the first: a ring)
        crosses a link that a push could not (no work per step while no link is set aside)."""
        down = self.unlinked.active()
        if not down:
            return False
        ids = [h.peer_id for h in hops]
        return any(f"{a}>{b}" in down for a, b in zip(ids, ids[1:] + ids[:1]))

    def record(self, hop: Hop, exc: BaseException) -> FailureRecord:
        """Ban (or mask) the peer behind a failed hop and describe what was done."""
        if not is_retriable(exc):
            return FailureRecord(hop, describe(exc), "not retried")
        if isinstance(exc, OverloadedError):
            return FailureRecord(hop, describe(exc), f"masked as overloaded {self.overloaded.ban(hop.peer_id):g}s")
        if isinstance(exc, RangeMovedError):
            return FailureRecord(hop, describe(exc), "route stale, re-reading the plan")
        return FailureRecord(hop, describe(exc), f"banned {self.bans.ban(hop.peer_id):g}s")
