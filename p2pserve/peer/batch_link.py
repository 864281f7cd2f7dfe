"""One stream from this peer to a next peer, carrying the ring steps of all sessions as batches.

A ring step used to travel on a stream of its own session, as a frame and an acknowledgement.
With 32 sessions in three peers' rings, that was 32 small frames a hop for each step a peer
ran, and most of a peer's event-loop time went to writing them. The receiving peer also took
them in one by one, so its worker often started a step before the rest of the sender's step
had arrived: a micro-batch of 16 fell apart into several small ones, each reading every weight.

So ring steps after a ring's start go to a next peer on one ``BatchLink``: the steps that this
peer's event loop sends on in one turn (all sessions of one compute step, since the worker
hands out a step's results at once) leave as one ``PushBatch`` frame, and the next peer answers
each frame with one ``PushBatchAck`` listing the items that failed. The next peer submits a
batch's items to its worker together (``ComputeWorker.hold_next_step``), so the batch runs
there as one step too, and reads the stream on while a batch runs (acks come as batches finish),
so the sender's next batch can join its next step rather than wait behind this one's compute.

What a session learns from the link is what it learned from its own stream: its item's outcome
(acked, or the ErrorReply it failed with), a later failure of one of its steps told up the ring
(an ``ErrorReply`` naming the next peer's session id), or the end of the link. A batch not acked
within ``timeout_s`` ends the link: the next peer stopped answering.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

import msgspec

from p2pserve.errors import WIRE_ERRORS, BadRequestError, ErrorCode
from p2pserve.peer.push_link import StreamLink, tell
from p2pserve.protocol import (
    MAX_BATCH_ITEMS,
    ErrorReply,
    FrameLimits,
    PushBatch,
    PushBatchAck,
    PushForward,
    error_reply,
)
from p2pserve.transport import Stream
from p2pserve.types import PeerId, SessionId

log = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()

#: The most batches a link keeps waiting for their acks; past it, the next peer stopped answering.
MAX_PENDING_BATCHES = 64
#: The most batches of one stream a peer runs at once (acks go in the order batches finish).
MAX_RUNNING_BATCHES = 8


@dataclass
class Watch:
    """What a session hears from the link: ``failed(reply)`` for its item's failure or a later
    failure of its ring (``reply`` names the next peer's session id and the step), ``broken()``
    when the link ended with its step unacked. ``owner`` is the sending session (for pruning)."""

    owner: object
    failed: Callable[[ErrorReply], None]
    broken: Callable[[], None]


@dataclass
class _Item:
    push: PushForward
    payload: bytes


def frames_of(items: list[_Item], max_header_bytes: int) -> list[list[_Item]]:
    """``items`` cut into runs that each fit one PushBatch: at most ``MAX_BATCH_ITEMS`` items
    whose encoded steps take at most ``max_header_bytes`` together (one item always fits: the
    frame limits bound a single step far below that), no session twice in one run."""
    runs: list[list[_Item]] = [[]]
    size, sessions = 0, set()
    for item in items:
        n, sid = len(_encoder.encode(item.push)), item.push.forward.session_id
        if runs[-1] and (len(runs[-1]) >= MAX_BATCH_ITEMS or size + n > max_header_bytes or sid in sessions):
            runs.append([])
            size, sessions = 0, set()
        runs[-1].append(item)
        size += n
        sessions.add(sid)
    return [run for run in runs if run]


class BatchLink(StreamLink):
    """This peer's stream to ``peer_id`` for ring steps: ``put(push, payload, watch)`` queues a
    step (sent with the others of this event-loop turn); ``close()`` ends the link."""

    def __init__(self, peer_id: PeerId, stream: Stream, limits: FrameLimits, timeout_s: float):
        self.timeout_s = timeout_s
        self._outbox: list[_Item] = []
        self._watches: dict[SessionId, Watch] = {}  # the next peer's session id -> its watcher here
        # batches written and not yet acked: seq -> (the next peer's session ids, ack timer)
        self._pending: dict[int, tuple[list[SessionId], asyncio.TimerHandle]] = {}
        self._seq = itertools.count()
        super().__init__(peer_id, stream, limits)

    def put(self, push: PushForward, payload: bytes, watch: Watch) -> None:
        """Queue ring step ``push`` (``payload``: its tensor's bytes); ConnectionError when the link is down."""
        if self._broken is not None:
            raise ConnectionError(f"link to {self.peer_id} is down: {self._broken!r}")
        self._watches[push.forward.session_id] = watch
        self._outbox.append(_Item(push, payload))
        if len(self._outbox) == 1:  # the first of this turn: flush once the turn's others are in
            asyncio.get_running_loop().call_soon(self._flush)

    def forget(self, keep: Callable[[object], bool]) -> None:
        """Drop the watches of sending sessions ``keep`` refuses (closed ones)."""
        for sid in [sid for sid, w in self._watches.items() if not keep(w.owner)]:
            del self._watches[sid]

    def _flush(self) -> None:
        items, self._outbox = self._outbox, []
        for frame in frames_of(items, self.frames.limits.max_header_bytes // 2):
            if self._broken is not None:
                return
            if len(self._pending) >= MAX_PENDING_BATCHES:
                self._fail(ConnectionError(f"{self.peer_id} left {MAX_PENDING_BATCHES} batches unacked"))
                return
            seq = next(self._seq)
            msg = PushBatch(seq=seq, items=[i.push for i in frame])
            timer = asyncio.get_running_loop().call_later(
                self.timeout_s, lambda seq=seq: self._fail(TimeoutError(f"{self.peer_id} did not ack batch {seq}")))
            self._pending[seq] = ([i.push.forward.session_id for i in frame], timer)
            asyncio.ensure_future(self._write(msg, b"".join(i.payload for i in frame)))

    async def _write(self, msg: PushBatch, payload: bytes) -> None:
        try:
            async with self._write_lock:  # frames leave whole and in the order they were made
                await self.frames.send(msg, payload)
        except Exception as e:  # the transport's own error: the link is gone
            self._fail(e)

    async def _read(self) -> None:
        """Match acks to batches in order; hand failures to their sessions; end the link on
        anything else."""
        try:
            while True:
                reply, _ = await self.frames.read()  # raises MalformedFrameError: the link ends
                if isinstance(reply, PushBatchAck):
                    self._acked(reply)
                elif isinstance(reply, ErrorReply) and reply.session_id in self._watches:
                    self._watches[reply.session_id].failed(reply)  # a later failure told up the ring
                elif isinstance(reply, ErrorReply) and reply.session_id is None and reply.step in self._pending:
                    # the next peer refused the batch frame itself (naming its seq as the step):
                    # every item of it failed there
                    sids, timer = self._pending.pop(reply.step)
                    timer.cancel()
                    for sid in sids:
                        self._tell(sid, reply)
                else:
                    raise ConnectionError(f"{self.peer_id} sent a {type(reply).__name__} nothing asked for")
        except asyncio.CancelledError:
            self._fail(ConnectionError(f"link to {self.peer_id} closed"))
            raise
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            self._fail(ConnectionError(f"{self.peer_id} closed the stream ({type(e).__name__})"))
        except Exception as e:  # a malformed frame, or the transport's own error
            self._fail(e)

    def _acked(self, ack: PushBatchAck) -> None:
        if ack.seq not in self._pending:
            raise ConnectionError(f"{self.peer_id} acked batch {ack.seq}, which is not awaiting an ack")
        sids, timer = self._pending.pop(ack.seq)
        timer.cancel()
        sent = set(sids)
        for reply in ack.failed:
            if reply.session_id in sent:  # an ack may name only the batch's own items
                self._tell(reply.session_id, reply)

    def _tell(self, sid: Optional[SessionId], reply: ErrorReply) -> None:
        watch = self._watches.get(sid) if sid is not None else None
        if watch is not None:
            watch.failed(reply)

    def _fail(self, exc: BaseException) -> None:
        """End the link: sessions with a step still unacked on it hear it broke; the others
        dial a new link with their next step."""
        if self._broken is not None:
            return
        self._broken = exc
        unacked = {sid for sids, _ in self._pending.values() for sid in sids} | {
            i.push.forward.session_id for i in self._outbox}
        for _, timer in self._pending.values():
            timer.cancel()
        self._pending.clear()
        self._outbox.clear()
        log.info("ring link to %s ended: %r", self.peer_id, exc)
        for sid in unacked:
            watch = self._watches.get(sid)
            if watch is not None:
                watch.broken()
        self.stream.close()

    def close(self) -> None:
        """Close the stream; steps still unacked on it count as broken."""
        self._reader.cancel()
        self._fail(ConnectionError(f"link to {self.peer_id} closed"))


class BatchLinks:
    """This peer's ring-step links, one per next peer: ``await get(peer_id)`` dials one on first
    use (one dial however many sessions ask at once) with ``dial(peer_id)``, which raises
    ConnectionError or TimeoutError when that peer cannot be reached."""

    def __init__(self, dial: Callable[[PeerId], Awaitable[Stream]], limits: FrameLimits, timeout_s: float):
        self.dial, self.limits, self.timeout_s = dial, limits, timeout_s
        self._links: dict[PeerId, BatchLink] = {}
        self._dials: dict[PeerId, asyncio.Future] = {}

    async def get(self, peer_id: PeerId) -> BatchLink:
        """The link to ``peer_id``, dialled if there is none that works."""
        link = self._links.get(peer_id)
        if link is not None and not link.broken:
            return link
        dialing = self._dials.get(peer_id)
        if dialing is None:
            dialing = self._dials[peer_id] = asyncio.ensure_future(self._open(peer_id))
            dialing.add_done_callback(lambda _: self._dials.pop(peer_id, None))
        return await asyncio.shield(dialing)

    async def _open(self, peer_id: PeerId) -> BatchLink:
        link = self._links[peer_id] = BatchLink(peer_id, await self.dial(peer_id), self.limits, self.timeout_s)
        return link

    def prune(self, keep: Callable[[object], bool]) -> None:
        """Forget the watches of sessions ``keep`` refuses, and links that ended. An idle link
        stays (the next peer ends it once it idles too long): one just dialled is idle until the
        sessions that waited for it put their steps."""
        for peer_id, link in list(self._links.items()):
            link.forget(keep)
            if link.broken:
                del self._links[peer_id]


def split_batch(msg: PushBatch, payload: bytes) -> list[tuple[PushForward, bytes]]:
    """A received batch's items, each with its payload bytes; BadRequestError unless the items
    are ring steps of distinct sessions whose tensors add up to the payload."""
    sizes = [item.forward.tensor.nbytes for item in msg.items]
    if sum(sizes) != len(payload):
        raise BadRequestError(f"a batch's items carry {sum(sizes)} bytes, its payload {len(payload)}")
    if any(not item.ring for item in msg.items):
        raise BadRequestError("a batch carries ring steps only")
    if len({item.forward.session_id for item in msg.items}) != len(msg.items):
        raise BadRequestError("a batch names a session twice")
    offsets = list(itertools.accumulate(sizes, initial=0))
    return [(item, payload[a:b]) for item, a, b in zip(msg.items, offsets, offsets[1:])]


async def batch_ack(seq: int, runs: list[asyncio.Future]) -> PushBatchAck:
    """Batch ``seq``'s ack once its items' runs are done (each None, or its ErrorReply)."""
    return PushBatchAck(seq=seq, failed=[reply for reply in await asyncio.gather(*runs) if reply is not None])


async def run_item(push, item: PushForward, payload: bytes, *args) -> Optional[ErrorReply]:
    """One item of a received batch, run by ``push(item, payload, *args)`` (the peer's handling
    of a lone PushForward): None when it ran here and was sent on, else its ErrorReply."""
    fwd = item.forward
    try:
        reply, _ = await push(item, payload, *args)
    except WIRE_ERRORS as e:
        return error_reply(e.code, e.message, fwd.session_id, fwd.step)
    except Exception as e:  # never let one item end the batch: it fails alone
        log.exception("ring step of a batch failed")
        return error_reply(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}", fwd.session_id, fwd.step)
    return reply if isinstance(reply, ErrorReply) else None


async def ack_later(seq: int, runs: list[asyncio.Future], stream) -> None:
    """Write batch ``seq``'s ack on ``stream`` (an ``InboundStream``) once its items are done."""
    try:
        await tell(stream.writer, await batch_ack(seq, runs))
    finally:
        stream.batches -= 1
