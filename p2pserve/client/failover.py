"""A session that survives peer failures: ban, re-route, replay the history, carry on.

:class:`FailoverSession` has the ``InferenceSession`` interface (``position``, ``history``,
``max_length``, ``rewind``, ``step``, ``close``), so ``stream_generate`` drives it unchanged.
Underneath it holds one ``InferenceSession`` over the current route. When any hop of that route
fails (connection lost, timeout, a typed error such as "overloaded" or "range moved"):

1. the failing hop's peer is banned for a while, with exponential backoff per repeat offence
   (``ClientConfig.ban_base_s`` doubling up to ``ban_max_s``); "overloaded" is a short,
   non-escalating mask instead, since the peer is healthy, just full; "range moved" bans no one:
   the peer is healthy and our view of the swarm is stale, so the route provider is told to
   re-read the plan (its ``invalidate()``, when it has one) and the client pauses
   ``ClientConfig.stale_route_pause_s`` for the peer's new announcement to land;
2. the route provider builds a new route over what remains (IWRR over the plan, or known peers);
3. the new session receives the whole token history plus the pending tokens as one prefill.
   Peers sample with a seed per absolute position, so the token that comes back is the one the
   failed route would have produced: greedy and seeded sampling both stay token-identical.

Failures are counted per ``step`` (a successful step resets the count) and bounded by
``ClientConfig.max_retries``; then :class:`GenerationFailedError` lists every hop that failed and
why. A client-side mistake (remote ``BadRequestError``) is not retried: it would fail anywhere.

The decisions (what to ban, for how long, when to give up, the error text) are pure and
unit-tested; the async part only opens sessions and moves the history.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional, Sequence

from p2pserve.client.connection import Hop, HopConnection
from p2pserve.client.routing import Masks, RouteGraph, Router
from p2pserve.config import ClientConfig
from p2pserve.errors import (
    AllRoutesOverloadedError,
    BadRequestError,
    GenerationFailedError,
    NoRouteError,
    OverloadedError,
    RangeMovedError,
    RoutingError,
)

log = logging.getLogger(__name__)

RouteProvider = Callable[[Masks], Awaitable[list[Hop]]]
SessionFactory = Callable[[list[Hop]], Awaitable[object]]




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


# ----------------------------------------------------------------------------- pure parts


class BanList:
    """Peers banned until some time; each repeat offence doubles the ban (capped).

    ``escalate=False`` gives every offence the base duration (used for "overloaded").
    """

    def __init__(self, base_s: float, max_s: float, clock: Callable[[], float] = time.monotonic, escalate: bool = True):
        self.base_s = base_s
        self.max_s = max_s
        self.clock = clock
        self.escalate = escalate
        self.strikes: dict[str, int] = {}
        self.until: dict[str, float] = {}

    def ban(self, peer: str) -> float:
        """Ban ``peer`` now; returns the ban's duration in seconds."""
        n = self.strikes.get(peer, 0) + 1
        self.strikes[peer] = n
        duration = min(self.base_s * (2 ** (n - 1) if self.escalate else 1), self.max_s)
        self.until[peer] = max(self.until.get(peer, 0.0), self.clock() + duration)
        return duration

    def active(self) -> frozenset[str]:
        """Peers banned at this moment."""
        now = self.clock()
        return frozenset(p for p, t in self.until.items() if t > now)


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


@dataclass
class FailoverState:
    """Bans and failure log of one client, shared by its sessions (a client learns once)."""

    config: ClientConfig = field(default_factory=ClientConfig)
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self.bans = BanList(self.config.ban_base_s, self.config.ban_max_s, self.clock)
        self.overloaded = BanList(self.config.ban_base_s, self.config.ban_max_s, self.clock, escalate=False)

    def masks(self) -> Masks:
        """Masks for the next route."""
        return Masks(banned=self.bans.active(), overloaded=self.overloaded.active())

    def record(self, hop: Hop, exc: BaseException) -> FailureRecord:
        """Ban (or mask) the peer behind a failed hop and describe what was done."""
        if not is_retriable(exc):
            return FailureRecord(hop, describe(exc), "not retried")
        if isinstance(exc, OverloadedError):
            return FailureRecord(hop, describe(exc), f"masked as overloaded {self.overloaded.ban(hop.peer_id):g}s")
        if isinstance(exc, RangeMovedError):
            return FailureRecord(hop, describe(exc), "route stale, re-reading the plan")
        return FailureRecord(hop, describe(exc), f"banned {self.bans.ban(hop.peer_id):g}s")


# ----------------------------------------------------------------------------- route providers


class PeerListRoutes:
    """Routes over a fixed set of known peers (no control plane): IWRR over every valid edge.

    ``peers`` are ``(peer_id, start, end, maddrs)``; routes prefer long hops (see routing.py).
    """

    def __init__(self, num_layers: int, peers: Sequence[tuple[str, int, int, Sequence[str]]], seed: int):
        self.router = Router(RouteGraph.from_peers(num_layers, peers), seed=seed)

    async def __call__(self, masks: Masks) -> list[Hop]:
        return self.router.route(masks)


class ChainListRoutes:
    """Routes from an ordered list of candidate chains: the first whose peers are all usable."""

    def __init__(self, chains: Sequence[Sequence[Hop]]):
        self.chains = [list(c) for c in chains]

    async def __call__(self, masks: Masks) -> list[Hop]:
        reasons: dict[str, str] = {}
        overloaded = False  # some chain is blocked by load alone (it would work once peers free up)
        for chain in self.chains:
            bad = {h.peer_id: r for h in chain if (r := masks.reason(h.peer_id)) is not None}
            if not bad:
                return list(chain)
            reasons.update(bad)
            overloaded |= all(r != "banned" for r in bad.values())
        raise NoRouteError(f"every candidate chain has a masked peer: {reasons}", reasons, overloaded)


# ----------------------------------------------------------------------------- the session


class _TaggedConnection:
    """Wraps a HopConnection so that any failure names its hop (``HopFailure``)."""

    def __init__(self, conn: HopConnection):
        self._conn = conn
        self.hop = conn.hop

    async def open(self, *args, **kwargs):
        try:
            return await self._conn.open(*args, **kwargs)
        except Exception as e:
            raise HopFailure(self.hop, e) from e

    async def forward(self, *args, **kwargs):
        try:
            return await self._conn.forward(*args, **kwargs)
        except Exception as e:
            raise HopFailure(self.hop, e) from e

    async def forward_wire(self, *args, **kwargs):
        try:
            return await self._conn.forward_wire(*args, **kwargs)
        except Exception as e:
            raise HopFailure(self.hop, e) from e

    async def close(self):
        return await self._conn.close()


def tag_connections(session) -> None:
    """Make an (unopened) ``InferenceSession`` raise ``HopFailure`` naming the failed hop."""
    session.connections = [_TaggedConnection(c) for c in session.connections]


class FailoverSession:
    """An ``InferenceSession`` look-alike that re-routes and replays on hop failure.

    ``open_session(hops)`` must return an *opened* session over ``hops`` whose hop calls raise
    :class:`HopFailure` (see :func:`tag_connections`); ``routes(masks)`` returns the next route.
    """

    def __init__(
        self,
        routes: RouteProvider,
        open_session: SessionFactory,
        max_length: int,
        config: ClientConfig = ClientConfig(),
        state: Optional[FailoverState] = None,
    ):
        self.routes = routes
        self.open_session = open_session
        self.max_length = max_length
        self.config = config
        self.state = state if state is not None else FailoverState(config)
        self.history: list[int] = []
        self.failures: list[FailureRecord] = []  # every failed hop of this session, in order
        self.route_log: list[list[Hop]] = []  # every route this session opened, in order
        self._inner = None

    @property
    def position(self) -> int:
        """Tokens the current route holds (equal to ``len(history)``; replay keeps it so)."""
        return len(self.history)

    @property
    def route(self) -> list[Hop]:
        """The route in use (the last one opened)."""
        return self.route_log[-1] if self.route_log else []

    async def __aenter__(self) -> "FailoverSession":
        await self.open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def open(self) -> None:
        """Open a first route now (otherwise the first ``step`` does)."""
        await self._with_retries(lambda inner: None)

    async def step(self, token_ids: list[int]) -> int:
        """Feed ``token_ids`` after the history; returns the next token, whatever fails below."""
        if not token_ids:
            raise BadRequestError("step needs at least one token")
        if self.position + len(token_ids) > self.max_length:
            raise BadRequestError(f"session would exceed max_length {self.max_length}")
        token = await self._with_retries(lambda inner: inner.step(token_ids))
        self.history.extend(token_ids)
        return token

    def rewind(self, position: int) -> None:
        """Make the next step start at ``position``."""
        if not (0 <= position <= self.position):
            raise BadRequestError(f"cannot rewind to {position}; session holds {self.position} tokens")
        del self.history[position:]
        if self._inner is not None:
            self._inner.rewind(position)

    async def close(self) -> None:
        """Close the current route's session."""
        inner, self._inner = self._inner, None
        if inner is not None:
            await inner.close()

    async def _with_retries(self, call):
        """Run ``call(inner)`` on a live route, rebuilding (with replay) after hop failures."""
        attempts = 0
        while True:
            attempts += 1
            try:
                if self._inner is None:
                    await self._reopen()
                result = call(self._inner)
                return (await result) if asyncio.iscoroutine(result) else result
            except HopFailure as f:
                record = self.state.record(f.hop, f.cause)
                self.failures.append(record)
                log.warning(f"hop failed: {record}")
                await self._drop_inner()
                if not is_retriable(f.cause):
                    raise f.cause
                if attempts > self.config.max_retries:
                    raise GenerationFailedError(failure_message(self.failures, attempts)) from f
                if isinstance(f.cause, RangeMovedError):
                    invalidate = getattr(self.routes, "invalidate", None)
                    if invalidate is not None:
                        invalidate()
                    await asyncio.sleep(self.config.stale_route_pause_s)
            except RoutingError as e:
                await self._drop_inner()
                if not self.failures:
                    raise  # nothing failed yet: the swarm simply has no route (503 / 429)
                cls = AllRoutesOverloadedError if getattr(e, "overloaded", False) else GenerationFailedError
                raise cls(failure_message(self.failures, attempts, e)) from e

    async def _reopen(self) -> None:
        """Open a session on a new route and replay the history into it as one prefill.

        The replay is deferred to the caller's step when there is one: the history is prepended
        to the pending tokens, so the route sees a single prefill of ``history + pending``.
        """
        hops = await self.routes(self.state.masks())
        self.route_log.append(list(hops))
        inner = await self.open_session(hops)
        self._inner = _Replaying(inner, list(self.history))

    async def _drop_inner(self) -> None:
        inner, self._inner = self._inner, None
        if inner is not None:
            try:
                await inner.close()
            except Exception as e:  # best effort: the route is already being abandoned
                log.debug(f"closing a failed route: {describe(e)}")


class _Replaying:
    """A fresh inner session that still owes the history: the first step sends it as a prefill."""

    def __init__(self, inner, history: list[int]):
        self.inner = inner
        self.owed = history

    async def step(self, token_ids: list[int]) -> int:
        tokens = self.owed + list(token_ids)
        token = await self.inner.step(tokens)
        self.owed = []
        return token

    def rewind(self, position: int) -> None:
        if self.owed:
            # nothing sent yet on this route: shorten what is owed instead
            del self.owed[position:]
        else:
            self.inner.rewind(position)

    async def close(self) -> None:
        await self.inner.close()


def chain_session_factory(p2p, model_id: str, num_layers: int, max_length: int, sampling, config: ClientConfig,
                          session_id: Optional[str] = None) -> SessionFactory:
    """A factory opening tagged ``InferenceSession``s (the real network path).

    Every route gets a fresh session id: a peer that survived the failure may still hold the old
    session, and replay must not collide with it.
    """
    from p2pserve.client.session import InferenceSession

    async def open_session(hops: list[Hop]):
        session = InferenceSession(p2p, hops, model_id, num_layers, max_length, sampling, config)
        tag_connections(session)
        try:
            await session.open()
        except BaseException:
            await session.close()
            raise
        return session

    return open_session
