"""Push mode on the peer: accept a step from the previous hop, run it, send it on to the next.

The client opens a session on every hop as in client-driven mode (each peer's KV reservation and
owner checks are unchanged), then tells each hop after the first which peer may push into that
session (``AllowPush``, sent by the session's owner on its own stream). A ``PushForward`` names
a session and the rest of the route as peer ids and session ids only; the peer runs its span and
sends the hidden states to ``route[0]`` as a client of that peer (one stream per session, opened
with the same transport a client uses: libp2p, or the direct TLS path pinned through it).

Where the next hop is dialled comes from this peer's own view of the swarm, never from the
route: the addresses that peer announced in its PeerInfo, a record signed by that peer's own
key (``peer/next_hop.py``). A next hop this peer has no record of is reported unreachable
without dialling anything, so a client cannot make a peer open connections of its choosing.

The last hop's ForwardResult goes straight to the client: with the step's PushForward to the
first hop, the client posts an ``AwaitResult`` on its own stream to the last hop, which answers
it as soon as the step has run there (a 3-hop step costs 4 one-way delays, not 6). In a ring
every hop holds its signed ForwardResult of each step for the owner's AwaitResult too, so the
client sees what each hop consumed and returned, as when it drives the hops (verification). Every hop
answers whoever pushed to it with a ``PushAck`` once the rest of the chain acked, so a failure
still travels back to the client: an ``ErrorReply`` whose ``failed_peer`` names the hop that
failed (the next hop, or whatever later hop the next one named), and the client bans, re-routes
and replays as ever. A peer accepts a push only from the peer id the session's owner allowed.
Ring mode (``peer/ring.py``): the last hop also pushes the next step to the first; ring steps
go to the next peer in batches (``peer/batch_link.py``), acked once run and sent on, and a later
failure of one is told up the ring to the last hop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional, Sequence

import msgspec
import torch

from p2pserve.blame import blamed_hop
from p2pserve.config import AdmissionConfig, ForwardingConfig
from p2pserve.errors import WIRE_ERRORS, BadRequestError, ErrorCode, MalformedFrameError
from p2pserve.peer.batch_link import MAX_RUNNING_BATCHES, BatchLinks, Watch, ack_later, batch_ack, run_item, split_batch
from p2pserve.peer.next_hop import UNREACHABLE, check_route, unreachable
from p2pserve.peer.held_results import HeldResults
from p2pserve.peer.link_dialer import LinkDialer, Resolver, announced, dial_concurrency
from p2pserve.peer.push_link import PushLink, tell
from p2pserve.peer.ring import RingState, check_grant
from p2pserve.protocol import (
    AllowPush,
    AwaitResult,
    ErrorReply,
    Forward,
    FrameLimits,
    PushAck,
    PushAllowed,
    PushBatch,
    PushForward,
    PushHop,
    error_reply,
)
from p2pserve.transport import Transport
from p2pserve.transport.frames import tensor_from_wire, tensor_to_wire
from p2pserve.types import PeerId, SessionId

log = logging.getLogger(__name__)


class Forwarder:
    """The push half of a peer's session handler: grants, links to next hops, results held for
    the owner's ``AwaitResult``, and rings (``peer/ring.py``).

    ``run_local(forward, payload, owner)`` is the handler's own Forward path (it returns the
    ForwardResult and its payload, or raises a typed error); ``dialer`` (default: one over
    ``transport``, for next hops with the default stream bounds, ``peer/link_dialer.py``) dials
    next hops at the addresses ``resolve`` gives (None: this peer knows no one, and pushes nowhere).
    """

    def __init__(self, table, transport: Transport, self_id: str, limits: FrameLimits,
                 config: ForwardingConfig = ForwardingConfig(), resolve: Optional[Resolver] = None,
                 loop_ended: Optional[Callable[[str], None]] = None, dialer: Optional[LinkDialer] = None,
                 hold_step: Optional[Callable[[], Callable[[], None]]] = None):
        self.table = table
        # told when a session looping here does not run its next step at once (the compute
        # worker holds its next batch for looping sessions until they are back)
        self.loop_ended = loop_ended
        self.transport = transport
        self.self_id = self_id
        self.limits = limits
        self.config = config
        self.resolve = resolve
        self.dialer = dialer or LinkDialer(transport, dial_concurrency(AdmissionConfig().max_streams_per_owner),
                                           config.connect_timeout_s)
        self._grants: dict[str, tuple[object, str]] = {}  # session id -> (session, allowed peer id)
        self._rings: dict[str, tuple[object, RingState]] = {}  # session id -> (session, its granted ring)
        self._links: dict[str, PushLink] = {}  # our session id -> stream to its next hop
        self._held = HeldResults(config.wait_timeout_s)  # steps' outcomes until the owner asks
        self._pruned_at = -1  # the table's ``closes`` when this last forgot closed sessions
        # ring steps' links, one per next peer, dialled where that peer announced itself
        self._batch_links = BatchLinks(lambda peer: self.dialer.dial_announced(peer, self.resolve), limits,
                                       config.call_timeout_s)
        # keeps the worker's next step from starting while a batch's items are handed to it; it
        # returns the release (``ComputeWorker.hold_next_step``; None: nothing to hold)
        self.hold_step = hold_step

    async def allow(self, msg: AllowPush, stream) -> PushAllowed:
        """Record the owner's grant: ``msg.from_peer`` may push into ``msg.session_id`` (with
        ``msg.ring``: only that ring's steps).

        Refused (BadRequestError, which the owner takes as "drive this route", not as a failure)
        when this peer holds no record of ``msg.from_peer``: that peer dials this one where it
        announced itself, so two peers that do not see each other in one swarm (peers named by a
        fixed list, each in a DHT of its own) cannot push, and the first step would only fail."""
        session = self.table.get(msg.session_id, stream)  # only the owner may grant
        if msg.from_peer != self.self_id and not await announced(self.resolve, msg.from_peer):
            raise BadRequestError("this peer holds no record of the peer that would push to it: drive the route")
        self._prune()
        self._rings.pop(session.id, None)
        if msg.ring is not None:
            check_grant(msg.ring, msg.from_peer, self.self_id)
            if msg.ring.route:
                check_route(msg.ring.route, self.self_id)
            self._rings[session.id] = (session, RingState.of(msg.ring, msg.from_peer, self.self_id))
            self._held.drop(session.id)  # a new ring: nothing held from an old one
        self._grants[msg.session_id] = (session, msg.from_peer)
        return PushAllowed(session_id=msg.session_id)

    def session_for(self, session_id: SessionId, stream, remote: str):
        """The session a PushForward on ``stream`` (from ``remote``) may drive: one the stream
        opened (the first hop), or one whose grant names ``remote``; else SessionNotFoundError,
        exactly as for an id never opened."""
        grant = self._grants.get(session_id)
        if grant is not None and grant[1] == remote:
            return self.table.get(session_id, grant[0].owner)  # raises unless still open
        return self.table.get(session_id, stream)

    def _admit_ring(self, session, msg: PushForward, payload: bytes, by_owner: bool) -> Optional[RingState]:
        """The session's ring when ``msg`` is one of its steps (checked against the grant: raises
        BadRequestError), None for a plain push. A ring grant admits ring steps only."""
        ring = self._rings.get(session.id, (None, None))[1]
        if ring is None:
            if msg.ring:
                raise BadRequestError("no ring was granted on this session")
            return None
        if by_owner:  # the owner starts the ring at the first hop (any other push of its own ends it)
            if not msg.ring:
                self._rings.pop(session.id, None)
            return ring if msg.ring and msg.forward.step == ring.grant.start_step else None
        if not msg.ring or (ring.first and msg.route):
            raise BadRequestError("this session's grant admits only its ring's steps, routed by the owner")
        fwd = msg.forward
        n = fwd.tensor.shape[0] if fwd.tensor.shape else 0
        token = None
        if ring.first and n == 1 and fwd.tensor.dtype == "int64":
            token = int(tensor_from_wire(fwd.tensor, payload)[0])
        ring.admit(fwd, n, token)
        return ring

    async def push(self, msg: PushForward, payload: bytes, stream, remote: str, run_local) -> tuple[object, bytes]:
        """Run ``msg`` here and, when a route follows, on the next hops; the reply to whoever
        pushed: a PushAck, or an ErrorReply naming the later hop at fault. A ring's step after
        its start is acked once it ran here and was sent on (``_ring_on``)."""
        check_route(msg.route, self.self_id)
        fwd = msg.forward
        session = self.session_for(fwd.session_id, stream, remote)
        ring = self._admit_ring(session, msg, payload, by_owner=stream is session.owner)
        route = ring.grant.route if ring is not None and ring.first and msg.ring else msg.route
        if ring is not None and not ring.last and stream is not session.owner:
            ring.upstream = getattr(stream, "writer", None)  # where a later failure of its steps is told
        if not route:  # the last hop: the result is the owner's, through its AwaitResult
            if ring is not None and ring.loop:
                ring.runner = run_local  # it runs the ring's next steps itself
            await self._run_last(session, fwd, payload, run_local, ring)
            return PushAck(session_id=session.id, step=fwd.step), b""
        result, out = await run_local(msgspec.structs.replace(fwd, outputs=1), payload, session.owner)
        if result.tensor is None:  # this span ends at the last layer: nothing to forward
            raise BadRequestError("a push route cannot follow the hop holding the last layer")
        if ring is not None:  # every hop of a ring holds its signed output for the owner to read
            self._deliver(session, fwd.step, result, out)
        nxt = route[0]
        onward = PushForward(forward=msgspec.structs.replace(fwd, session_id=nxt.session_id, tensor=result.tensor),
                             route=route[1:], ring=msg.ring)
        try:
            if ring is not None and fwd.step != ring.grant.start_step:
                await self._ring_on(session, ring, nxt, onward, out)
                return PushAck(session_id=session.id, step=fwd.step), b""
            reply = await self._call_next(session, nxt, onward, out)
        except (*WIRE_ERRORS, ConnectionError, TimeoutError, asyncio.IncompleteReadError) as e:
            self._drop_link(fwd.session_id)  # out of sync, or gone
            log.info("push to %s failed: %r", nxt.peer_id, e)  # the detail stays here (next_hop.unreachable)
            return unreachable(nxt.peer_id, fwd.session_id, fwd.step), b""
        if isinstance(reply, ErrorReply):
            return msgspec.structs.replace(reply, session_id=session.id, step=fwd.step), b""
        return PushAck(session_id=session.id, step=fwd.step), b""

    async def _run_last(self, session, fwd: Forward, payload: bytes, run_local, ring: Optional[RingState]) -> None:
        """The last hop runs a pushed step, hands its outcome to the owner's AwaitResult, and
        (in a ring) pushes the next step to the first hop."""
        if ring is not None:  # a ring step's last-hop fields are the owner's grant's, never a peer's
            fwd = msgspec.structs.replace(fwd, context=ring.context_of(fwd), allowed=None, prompt_logprobs=False)
        try:
            # a loop's step is followed at once by its next one: the worker may hold its next
            # batch for it (``ComputeWorker``: looping sessions step together)
            looping = ring is not None and ring.loop
            result, out = await (run_local(fwd, payload, session.owner, loops=True) if looping
                                 else run_local(fwd, payload, session.owner))
        except Exception as e:
            code = e.code if isinstance(e, WIRE_ERRORS) else ErrorCode.INTERNAL
            self._deliver(session, fwd.step, error_reply(code, f"{type(e).__name__}: {e}", session.id, fwd.step), b"")
            raise
        self._deliver(session, fwd.step, result, out)
        if ring is None or ring.failure is not None or result.token is None:
            if ring is not None and ring.loop and self.loop_ended is not None:
                self.loop_ended(session.id)
            return
        n = fwd.tensor.shape[0]
        move = ring.after(fwd.step, fwd.position + n, result.token)
        if move == "push":
            await self._ring_push(session, ring, fwd.step + 1, fwd.position + n, result.token)
            return
        if ring.loop and self.loop_ended is not None:
            self.loop_ended(session.id)
        if move == "stop":
            self._answer_waiter(session)

    async def _ring_push(self, session, ring: RingState, step: int, position: int, token: int) -> None:
        """The last hop closes the ring: step ``step`` (``token`` at ``position``) to the first hop,
        or, when this peer is the whole ring, to itself."""
        meta, data = tensor_to_wire(torch.tensor([token], dtype=torch.int64))
        ring.fed = (step, token)
        succ = ring.grant.successor
        if ring.loop:
            fwd = Forward(session_id=session.id, step=step, position=position, tensor=meta)
            asyncio.ensure_future(self._loop_step(session, ring, fwd, bytes(data)))
            return
        msg = PushForward(forward=Forward(session_id=succ.session_id, step=step, position=position, tensor=meta),
                          ring=True)
        try:
            await self._ring_on(session, ring, succ, msg, bytes(data))
        except (*WIRE_ERRORS, ConnectionError, TimeoutError) as e:
            self._drop_link(session.id)
            log.info("ring push to %s failed: %r", succ.peer_id, e)
            self._ring_failed(session, ring, step, succ.peer_id, UNREACHABLE)

    async def _ring_on(self, session, ring: RingState, nxt: PushHop, onward: PushForward, payload: bytes) -> None:
        """Send a ring step on, with the others this peer sends to the same next peer in this
        turn (``peer/batch_link.py``), without waiting for its ack; a failure of it reported
        later (an error reply, a broken link, no ack in time) is told up the ring (``_ring_failed``)."""
        link = await self._batch_links.get(nxt.peer_id)
        later = frozenset(h.peer_id for h in onward.route)
        step = onward.forward.step

        def failed(reply: ErrorReply) -> None:
            # the last hop knows no route: it relays the first hop's blame, and the client checks it
            relayed = ring.last and reply.failed_peer not in (None, self.self_id)
            blamed = reply.failed_peer if relayed else blamed_hop(reply.failed_peer, later, nxt.peer_id)
            self._ring_failed(session, ring, reply.step or step, blamed, reply.message)

        link.put(onward, payload, Watch(session, failed,
                                        lambda: self._ring_failed(session, ring, step, nxt.peer_id, UNREACHABLE)))

    async def push_batch(self, msg: PushBatch, payload: bytes, stream, remote: str, run_local) -> tuple[object, bytes]:
        """Run a batch of ring steps pushed by ``remote`` (each as :meth:`push` runs one), to be
        answered with one PushBatchAck naming the items that failed. The items reach the worker
        together (``hold_step``), so they run here as one step.

        The ack is written when the batch is done, and meanwhile the stream reads on (reply None):
        the sender's next batch must not wait in the stream behind this one's compute, or it
        could not join this peer's next step. At most ``MAX_RUNNING_BATCHES`` of a stream's
        batches run at once; past that the stream waits for this one (its ack is the reply)."""
        items = split_batch(msg, payload)
        release = self.hold_step() if self.hold_step is not None else None
        try:
            runs = [asyncio.ensure_future(run_item(self.push, item, part, stream, remote, run_local))
                    for item, part in items]
        finally:
            if release is not None:  # after each item's first turn, which submits its job
                asyncio.get_running_loop().call_soon(release)
        if stream.batches >= MAX_RUNNING_BATCHES:
            return await batch_ack(msg.seq, runs), b""
        stream.batches += 1
        asyncio.ensure_future(ack_later(msg.seq, runs, stream))
        return None, b""

    async def _loop_step(self, session, ring: RingState, fwd: Forward, payload: bytes) -> None:
        """Run a loop's next step here (it runs the one after it in turn); a failure ends the
        ring, answered to the owner's wait."""
        try:
            if self._open(session) and ring.failure is None:
                await self._run_last(session, fwd, payload, ring.runner, ring)
        except Exception as e:  # the step's error reply is held for the owner already
            code = e.code.value if isinstance(e, WIRE_ERRORS) else type(e).__name__
            self._ring_failed(session, ring, fwd.step, self.self_id, f"step {fwd.step} failed here: {code}")

    def _ring_failed(self, session, ring: RingState, step: int, failed_peer: str, message: str) -> None:
        """The ring broke at ``failed_peer`` (first report only): the last hop answers the owner's
        wait with it; any other hop tells whoever pushed its ring steps to it."""
        if ring.loop and self.loop_ended is not None:
            self.loop_ended(session.id)
        if ring.failure is not None or not self._open(session):
            return
        log.info("ring of session %s broke at %s: %s", session.id, failed_peer, message)
        ring.failure = error_reply(ErrorCode.INTERNAL, f"ring broke at {failed_peer}: {message}", session.id, step,
                                   failed_peer)
        if ring.last:
            self._answer_waiter(session)
        elif ring.upstream is not None:
            asyncio.ensure_future(tell(ring.upstream, ring.failure))

    async def await_result(self, msg: AwaitResult, stream) -> Optional[tuple[object, bytes]]:
        """The owner's wait for its pushed step ``msg.step`` to run here (the route's last hop, or
        any hop of a ring): that step's ForwardResult and payload, the ErrorReply it ended in, or
        RingStopped (the ring ended before it); None when the owner hung up while it waited (the
        stream reads on meanwhile: ``peer/read_ahead.py``). ``msg.ring_until`` raises the ring's
        credit."""
        session = self.table.get(msg.session_id, stream)  # only the owner may wait
        self._prune()
        ring = self._ring_of(session)
        if ring is not None and ring.last and (go := ring.resume(msg.ring_until, msg.step)) is not None:
            await self._ring_push(session, ring, *go)
        ahead = getattr(stream, "ahead", None)
        return await self._held.wait(session, msg.step, ring, ahead.race if ahead is not None else None)

    def _ring_of(self, session) -> Optional[RingState]:
        """The ring granted on ``session`` here, if any."""
        return self._rings.get(session.id, (None, None))[1]

    def _deliver(self, session, step: int, reply, payload: bytes) -> None:
        """Hand a step's outcome to the owner's wait, or hold it for it."""
        self._held.deliver(session, step, reply, payload, self._ring_of(session))

    def _answer_waiter(self, session) -> None:
        """Answer the owner's pending wait if its answer (a ring's failure or end) is there now."""
        self._held.answer_waiter(session, self._ring_of(session))

    async def _call_next(self, session, nxt: PushHop, onward: PushForward, payload: bytes):
        """Send ``onward`` to ``nxt`` and return its checked reply: a PushAck, or an ErrorReply
        naming the hop at fault."""
        later = [h.peer_id for h in onward.route]
        link, fresh = await self._link(session, nxt, later)
        try:
            reply = await self._exchange(link, onward, payload)
        except (ConnectionError, asyncio.IncompleteReadError):
            if fresh:
                raise
            # A link idle past the next peer's stream timeout was closed by it: that is not the
            # next hop failing. Once more on a new stream (a repeated Forward rewinds, so it is safe).
            self._drop_link(session.id)
            link, _ = await self._link(session, nxt, later)
            reply = await self._exchange(link, onward, payload)
        if isinstance(reply, ErrorReply):
            # A later hop's own blame is relayed only if it names a hop after the next one.
            return msgspec.structs.replace(reply, failed_peer=blamed_hop(reply.failed_peer, link.later, nxt.peer_id))
        if not isinstance(reply, PushAck) or reply.step != onward.forward.step:
            raise MalformedFrameError(f"expected the PushAck of step {onward.forward.step}, got {reply!r:.80}")
        return reply

    async def _exchange(self, link: PushLink, msg: PushForward, payload: bytes):
        """One frame to the next hop and its reply, under the call timeout per hop still to run:
        the hop nearest a hang times out first, so it is the one named."""
        async with asyncio.timeout(self.config.call_timeout_s * (1 + len(msg.route))):
            return await (await link.send(msg, payload, msg.forward.step))

    async def _link(self, session, nxt: PushHop, later: Sequence[str] = ()) -> tuple[PushLink, bool]:
        """The stream to ``nxt`` for ``session``, opened on first use (authenticated to its id, at
        the addresses it announced), and whether it was opened just now."""
        link = self._links.get(session.id)
        if link is not None and link.peer_id == nxt.peer_id and link.session is session and not link.broken:
            link.later = frozenset(later)
            return link, False
        self._drop_link(session.id)
        self._prune()
        stream = await self.dialer.dial_announced(nxt.peer_id, self.resolve)  # where it announced itself
        link = self._links[session.id] = PushLink(nxt.peer_id, stream, session, self.limits)
        link.later = frozenset(later)
        return link, True

    def _drop_link(self, session_id: SessionId) -> None:
        link: Optional[PushLink] = self._links.pop(session_id, None)
        if link is not None:
            link.close()

    def _prune(self) -> None:
        """Forget grants, rings, links, held results and waits of sessions closed since the last look."""
        if self._pruned_at == self.table.closes:
            return
        self._pruned_at = self.table.closes
        for table in (self._grants, self._rings):
            for sid in [s for s, entry in table.items() if not self._open(entry[0])]:
                del table[sid]
        self._held.prune(self._open, self.table.closed_error)
        for sid in [s for s, link in self._links.items() if not self._open(link.session)]:
            self._drop_link(sid)
        self._batch_links.prune(self._open)

    def _open(self, session) -> bool:
        """Whether ``session`` is still the open session under its id."""
        try:
            return session is not None and self.table.get(session.id, session.owner) is session
        except WIRE_ERRORS:
            return False

