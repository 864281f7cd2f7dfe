"""One request's pipeline through the swarm: the route's connections, the token history, failover.

:meth:`Pipeline.step` returns the next token after the token ids it is given. A route of one
peer runs as a loop there and a ring runs peer to peer (``Pipeline.forwarding``, ARCHITECTURE.md
"Hop topology"); otherwise it drives the hops, handing each one's hidden states to the next.

The pipeline keeps the one token history of the request (prompt and generated tokens it sent)
and how much of it the current route's peers hold. When a hop fails it applies the pure
decisions of :mod:`p2pserve.client.failover`: ban (or mask) the peer, ask the
:class:`~p2pserve.client.route_providers.RouteProvider` for a new route, and send the new route
the whole history with the pending tokens as one prefill (the replay). Peers sample with a seed
per absolute position, so the replayed route returns the token the failed one would have.

Every route opens with a fresh session id: a peer that survived a failure may hold the old one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Optional, Sequence

import torch

from p2pserve.client.connection import HopConnection
from p2pserve.client.failover import (MAX_UNLINKS, FailoverState, FailureRecord, HopFailure, failure_message,
                                      next_move, no_hop_at_fault, route_pause, routes_exhausted)
from p2pserve.client.fork import open_forks
from p2pserve.client.hop import Hop, check_chain
from p2pserve.client.push import PushRefused
from p2pserve.client.route_forwarding import RouteForwarding
from p2pserve.config import PushConfig
from p2pserve.client.logprobs import check_reply_logprobs
from p2pserve.client.route_providers import ChainListRoutes, RouteProvider
from p2pserve.client.trust.protocol import HopObserver, StepTrust
from p2pserve.config import ClientConfig
from p2pserve.errors import BadRequestError, GenerationFailedError, RoutingError
from p2pserve.metrics import ClientMetrics, error_code
from p2pserve.protocol import MAX_VERIFY_OUTPUTS, Forward, SamplingParams
from p2pserve.transport import Transport
from p2pserve.transport.frames import tensor_to_wire

log = logging.getLogger(__name__)


class Pipeline:
    """One generation session of ``model_id`` through whatever route ``routes`` provides.

    ``state`` holds the bans, shared by every pipeline of one client; ``max_length`` bounds the
    positions the session will hold (the peers reserve KV cache for it). ``metrics`` (the
    client's) counts hop times, failed hops, failovers and the errors a request ends with.
    """

    def __init__(self, transport: Transport, routes: RouteProvider, model_id: str, num_layers: int, max_length: int,
                 sampling: SamplingParams = SamplingParams(), config: ClientConfig = ClientConfig(),
                 state: Optional[FailoverState] = None, vocab_size: Optional[int] = None,
                 observer: Optional[HopObserver] = None, trust: Optional[StepTrust] = None,
                 metrics: Optional[ClientMetrics] = None, extras: bool = False):
        self.transport = transport
        self.vocab_size = vocab_size  # when known, a last hop's token outside it is malformed
        self.observer = observer  # times decode hops for the service reports (client/trust/observer.py)
        self.metrics = metrics  # hop times, failed hops, failovers and failed requests, when given
        self._rerouting = False  # a hop failed and no route has been opened since (a failover under way)
        self._unlinks = 0  # links this pipeline found a push could not cross (``_unlink``)
        self.routes = routes
        self.model_id = model_id
        self.num_layers = num_layers
        self.max_length = max_length
        self.sampling = sampling
        self.config = config
        self.state = state if state is not None else FailoverState(config)
        self.history: list[int] = []  # every token id the peers were sent, in order (the replay)
        self.failures: list[FailureRecord] = []  # every failed hop of this pipeline, in order
        self.route_log: list[list[Hop]] = []  # every route opened, in order
        self._links: Optional[list[HopConnection]] = None  # the current route's connections
        self._held = 0  # how many history tokens the current route's peers hold
        self._steps = 0  # Forward counter of the current route
        self.trust = trust  # verification's view of this pipeline (client/trust/), None: unverified
        self.verified: list[int] = []  # the last hop's tokens of the latest step with outputs > 1
        # when and how steps go peer to peer (client/push.py, client/ring.py)
        self.forwarding = RouteForwarding(config.push, max_length)
        # the last hop gets each driven step's token ids (``Forward.context``: penalties, prompt
        # log-probabilities) and maybe a grammar mask, which go client-driven; penalties also ring
        # (``RingGrant.context``); the tape keeps the context for a witness's replay
        self.extras = extras
        self.last_reply = None  # the last hop's reply of the latest step (its log-probabilities)
        self._stepping = asyncio.Lock()  # held through a step: a fork of this pipeline waits for it
        self._fork: Optional[tuple["Pipeline", int]] = None  # (parent, positions) the first route forks

    @property
    def position(self) -> int:
        """Tokens of the history (what the next step follows)."""
        return len(self.history)

    @property
    def route(self) -> list[Hop]:
        """The route in use (the last one opened)."""
        return self.route_log[-1] if self.route_log else []

    async def __aenter__(self) -> "Pipeline":
        await self.open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def open(self) -> None:
        """Open a route now, so that "no route" or "overloaded" surface before any token."""
        base, waited = len(self.failures), 0.0
        while self._links is None:
            attempts = len(self.failures) - base + 1  # failed hops, not waits for a route, count
            try:
                await self._open_route()
            except HopFailure as f:
                await self._recover(f, attempts)
            except RoutingError as e:
                waited = await self._await_route(e, waited, attempts)

    def fork_from(self, parent: "Pipeline", positions: int) -> None:
        """Open the first route as a fork of ``parent``'s route: the same hops, each session
        starting with ``parent``'s first ``positions`` positions (``OpenSession.fork_of``), so
        their KV is shared rather than computed again. When that fails (a peer gone, the parent
        closed), the route opens as usual and the history is sent in full."""
        self._fork = (parent, positions)

    async def step(self, token_ids: Sequence[int], outputs: int = 1, allowed: Optional[bytes] = None,
                   prompt_logprobs: bool = False) -> int:
        """Feed ``token_ids`` after the history; returns the next token (:meth:`_step`)."""
        async with self._stepping:
            return await self._step(token_ids, outputs, allowed, prompt_logprobs)

    async def _step(self, token_ids: Sequence[int], outputs: int = 1, allowed: Optional[bytes] = None,
                    prompt_logprobs: bool = False) -> int:
        """Feed ``token_ids`` after the history; returns the next token, whatever fails below.

        The route first gets the history it does not hold: after a re-route that is all of it,
        sent with ``token_ids`` as one prefill. ``outputs`` > 1 (speculative verification, :meth:`verify`)
        asks the last hop for the token after each of the last ``outputs`` of ``token_ids`` (left in
        ``self.verified``); ``allowed`` (a grammar's mask) and ``prompt_logprobs`` go to a driven
        step's last hop (:attr:`extras` must be on); its checked reply is left in ``self.last_reply``.
        """
        if not 1 <= outputs <= min(len(token_ids), MAX_VERIFY_OUTPUTS):
            raise BadRequestError(f"a step needs at least one token and {outputs} output(s), got {len(token_ids)} tokens")
        if self.position + len(token_ids) > self.max_length:
            raise BadRequestError(f"session would exceed max_length {self.max_length}")
        base, waited = len(self.failures), 0.0
        while True:
            attempts = len(self.failures) - base + 1  # failed hops, not waits for a route, count
            pushed = False
            try:
                if self._links is None:
                    await self._open_route()
                sent = self.history[self._held:] + list(token_ids)
                meta, data = tensor_to_wire(torch.tensor(sent, dtype=torch.int64))
                pushed = (allowed is None and not prompt_logprobs
                          and self.forwarding.use(self._links, self._taping(), outputs, self.sampling.needs_history)
                          and not self.state.unlinked_in(c.hop for c in self._links))
                if pushed:
                    try:
                        reply = await self._push(sent, meta, data, outputs)
                    except PushRefused:  # the route's peers take no push-mode steps: drive them
                        self.forwarding.refused, pushed = True, False
                if not pushed:
                    last = dict(context=sent, allowed=allowed, prompt_logprobs=prompt_logprobs) if self.extras else {}
                    reply = await self._drive(sent, meta, data, outputs, last)
            except HopFailure as f:
                if pushed and no_hop_at_fault(f.cause) and self._unlinks < MAX_UNLINKS:
                    await self._unlink(f)
                else:
                    await self._recover(f, attempts)
                continue
            except RoutingError as e:
                await self._drop_route()
                waited = await self._await_route(e, waited, attempts)
                continue
            break
        self._steps += 1
        self.last_reply = reply
        if self.trust is not None:
            self.trust.after_step(self.sampling)
        self.history.extend(token_ids)
        self._held = len(self.history)
        if outputs > 1:
            self.verified = list(reply.tokens)  # check_forward made sure there are ``outputs``
            return self.verified[-1]
        return int(reply.token)  # check_forward made sure the last hop sent one

    def _taping(self) -> bool:
        """Whether verification records this route's exchanges (a taped route is never pushed)."""
        return self.trust is not None and self.trust.taping

    async def _drive(self, sent: list[int], meta, data, outputs: int, last_fields: Optional[dict] = None):
        """Client-driven hops: send ``sent`` (``meta``/``data`` on the wire) to each hop in turn,
        handing each hop's hidden states to the next; returns the last hop's checked reply.
        ``last_fields`` are the last hop's own Forward fields (``Pipeline.extras``)."""
        observe = self.observer if len(sent) == 1 else None  # decode steps only
        timed = None if self.metrics is None else (
            self.metrics.hop_decode if len(sent) == 1 else self.metrics.hop_prefill)
        last = len(self._links) - 1
        tape = self.trust if self._taping() else None
        for i, link in enumerate(self._links):
            try:
                msg = Forward(session_id=link.session_id, step=self._steps, position=self._held, tensor=meta,
                              outputs=outputs if i == last else 1, **((last_fields or {}) if i == last else {}))
                inputs = data
                t0 = time.perf_counter()
                reply, data = await link.call(msg, data)
                elapsed = time.perf_counter() - t0
                if observe is not None:
                    observe.decode(link.hop.peer_id, link.hop.end - link.hop.start, elapsed)
                if timed is not None:
                    timed.observe(elapsed)
                meta = link.check_forward(reply, data, len(sent), self._steps, self._held,  # handed on undecoded
                                          link.hop.end == self.num_layers, self.vocab_size, msg.outputs)
                if i == last:
                    check_reply_logprobs(reply, self.sampling, len(sent), msg, self.vocab_size)
                if tape is not None:  # kept for re-execution: references
                    tape.record(i, self._held, len(sent), msg.tensor.dtype, inputs, reply, data, msg.context, msg.allowed)
            except Exception as e:  # whatever broke on this hop is this hop's failure
                raise HopFailure(link.hop, e) from e
        return reply

    async def _push(self, sent: list[int], meta, data, outputs: int):
        """The step peer to peer (:class:`~p2pserve.client.route_forwarding.RouteForwarding`)."""
        msg = Forward(session_id=self._links[0].session_id, step=self._steps, position=self._held, tensor=meta,
                      outputs=outputs)
        timed = None if self.metrics is None else (
            self.metrics.hop_decode if len(sent) == 1 else self.metrics.hop_prefill)
        history = self.sampling.needs_history
        reply = await self.forwarding.step(self._links, msg, sent, data, self._held, self.vocab_size, timed, history)
        try:  # log-probabilities come with the last hop's reply on every path
            check_reply_logprobs(reply, self.sampling, len(sent), msg, self.vocab_size)
        except Exception as e:
            raise HopFailure(self._links[-1].hop, e) from e
        if self._taping():  # a ring: each hop's input and signed output, taped as a driven step's
            self.forwarding.tape(self.trust, self._held, sent, meta.dtype, data, history)
        return reply

    async def verify(self, token_ids: Sequence[int], outputs: int) -> list[int]:
        """Feed ``token_ids`` (the pending token and k draft tokens, ``outputs`` = k + 1) and
        return the token the model picks after each of the last ``outputs`` of them.

        The whole of ``token_ids`` joins the history; the caller rewinds past the draft tokens
        it rejects (:meth:`rewind`), so a later replay sends only accepted tokens.
        """
        token = await self.step(token_ids, outputs)
        return self.verified if outputs > 1 else [token]

    def rewind(self, position: int) -> None:
        """Make the next step start at ``position`` (peers drop their later cache entries)."""
        if not 0 <= position <= self.position:
            raise BadRequestError(f"cannot rewind to {position}; session holds {self.position} tokens")
        del self.history[position:]
        self._held = min(self._held, position)

    async def close(self) -> None:
        """Close the current route's sessions and streams."""
        await self._drop_route()

    async def _open_route(self) -> None:
        """Open a session on every hop of a new route (in parallel); the route holds nothing yet.

        Raises ``HopFailure`` naming the first hop, in route order, that could not open.
        """
        fork, self._fork = self._fork, None
        if fork is not None and await self._open_fork(*fork):
            return
        masks = self.state.masks()
        hops = await self.routes.route(self.trust.masks(masks) if self.trust is not None else masks)
        check_chain(hops, self.num_layers)
        self.route_log.append(list(hops))
        cfg = self.config
        links = [HopConnection(self.transport, h, cfg.frame_limits, cfg.hop_timeout_s, cfg.connect_timeout_s)
                 for h in hops]
        # None: each hop draws its own random session id (never one id shared along the route).
        tasks = [asyncio.create_task(c.open(self.model_id, None, self.max_length, self.sampling)) for c in links]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            # The first failure cancels the opens still under way (they would hold KV on their
            # peers until their own timeouts), and whatever opened is closed again.
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            failed = [(c, t.exception()) for c, t in zip(links, tasks) if not t.cancelled() and t.exception()]
            if failed or any(t.cancelled() for t in tasks):
                await asyncio.gather(*(c.close() for c in links), return_exceptions=True)
        if failed:
            link, exc = failed[0]
            if not isinstance(exc, Exception):  # interrupted: not the hop's failure
                raise exc
            raise HopFailure(link.hop, exc) from exc
        self._links, self._held, self._steps = links, 0, 0
        self.forwarding.route_opened()
        if self._rerouting:  # a failover that found a route (one that found none ends the request)
            self._rerouting = False
            if self.metrics is not None:
                self.metrics.failovers.inc()
        if self.trust is not None:
            self.trust.route_opened(links)
        if self.observer is not None:
            for c in links:
                if c.open_rtt_s is not None:
                    self.observer.rtt(c.hop.peer_id, c.hop.end - c.hop.start, c.open_rtt_s)
                if c.opened is not None and c.opened.receipt:
                    self.observer.receipt(c.hop.peer_id, c.opened.receipt)

    async def _open_fork(self, parent: "Pipeline", at: int) -> bool:
        """Open sessions forking ``parent``'s on its route (:meth:`fork_from`); False if they
        could not all be opened (nothing is left open then)."""
        async with parent._stepping:  # the parent's sessions run no step while they are forked
            theirs = parent._links
            if theirs is None or parent._held < at:
                return False
            links = await open_forks(self.transport, self.config, self.model_id, self.max_length, self.sampling,
                                     theirs, at)
        if links is None:
            return False
        self.route_log.append([c.hop for c in links])
        self._links, self._steps = links, 0
        self.history, self._held = list(parent.history[:at]), at
        self.forwarding.route_opened()
        if self.trust is not None:
            self.trust.route_opened(links)
            self.trust.forked(parent.trust, at)
        return True

    async def _unlink(self, failure: HopFailure) -> None:
        """A hop could not push to ``failure.hop``, or a ring went silent: a failure of no hop the
        client can name. The link (a silent ring's every link) is set aside and the route dropped;
        the retry is driven by the client, whose own calls find a gone or silent peer."""
        self._unlinks += 1
        log.warning("%s", self.state.set_aside([c.hop.peer_id for c in self._links or ()], failure))
        await self._drop_route(settle_s=0.0)

    async def _recover(self, failure: HopFailure, attempts: int) -> None:
        """Record a failed hop and drop the route; raises when re-routing cannot help."""
        record = self.state.record(failure.hop, failure.cause)
        self.failures.append(record)
        log.warning("hop failed: %s", record)
        if self.metrics is not None:
            self.metrics.hop_errors.labels(error_code(failure.cause)).inc()
        await self._drop_route(settle_s=0.0)
        move = next_move(failure.cause, attempts, self.config.max_retries)
        if move == "raise":
            raise self._failed(failure.cause)
        if move == "give up":
            raise self._failed(GenerationFailedError(failure_message(self.failures, attempts))) from failure
        self._rerouting = True
        if move == "re-read":
            self.routes.invalidate()
            await asyncio.sleep(self.config.stale_route_pause_s)

    async def _await_route(self, exc: RoutingError, waited: float, attempts: int) -> float:
        """No usable route: pause and let the next try re-read the swarm (returns the time waited
        so far), or raise once ``no_route_wait_s`` is spent."""
        pause = route_pause(exc, waited, self.config.no_route_wait_s)
        if pause is None:
            if not self.failures:
                raise self._failed(exc)  # nothing failed yet: the swarm simply has no route (503 / 429)
            raise self._failed(routes_exhausted(exc, self.failures, attempts)) from exc
        log.info("no usable route (%s); re-reading the swarm in %.2f s", exc, pause)
        self.routes.invalidate()
        await asyncio.sleep(pause)
        return waited + pause

    def _failed(self, exc: BaseException) -> BaseException:
        """``exc``, which ends the request, counted by its code."""
        if self.metrics is not None:
            self.metrics.request_errors.labels(error_code(exc)).inc()
        return exc

    async def _drop_route(self, settle_s: float = 2.0) -> None:
        if self.trust is not None:  # checks drawn for this route's hops run now, in the background
            self.trust.route_done()
        await self.forwarding.route_left(settle_s)  # before CloseSession
        links, self._links = self._links, None
        if links:  # best effort: the route is being abandoned
            await asyncio.gather(*(c.close() for c in links), return_exceptions=True)


async def open_chain(transport: Transport, hops: Sequence[Hop], model_id: str, num_layers: int, max_length: int,
                     sampling: SamplingParams = SamplingParams(), config: ClientConfig = ClientConfig(),
                     push: Optional[PushConfig] = None) -> Pipeline:
    """An opened pipeline over one explicit chain (no control plane: the caller names the hops).

    There is no other route to fail over to: a hop that fails is banned and the next step
    reports that no route is left.
    """
    config = replace(config, push=push) if push is not None else config
    pipeline = Pipeline(transport, ChainListRoutes([list(hops)]), model_id, num_layers, max_length, sampling, config)
    try:
        await pipeline.open()
    except BaseException:
        await pipeline.close()
        raise
    return pipeline
