"""A forwarding peer's stream to the next hop of one session: push mode's chain steps, and a
ring's first step (its later steps share one link per next peer, ``peer/batch_link.py``).

Writes do not wait for replies; one reader task matches the replies, in order, to the frames
that asked for them, and hands an error for a step already acked (a later hop's failure,
relayed back up) to ``on_unsolicited``, after which the link is closed (so a next hop cannot
keep the reader busy). ``StreamLink`` is the part a batch link shares: the reader task, one
write at a time, and the end state.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Callable, Optional

from p2pserve.errors import P2PServeError
from p2pserve.protocol import ErrorReply, FrameLimits
from p2pserve.transport import Stream
from p2pserve.transport.frames import write_frame
from p2pserve.transport.session_stream import SessionStream
from p2pserve.types import PeerId

log = logging.getLogger(__name__)

#: The most frames a link keeps waiting for their replies: a ring has one step in flight per
#: link, a chain one; anything past this is a next hop that stopped answering.
MAX_PENDING = 8


class StreamLink:
    """A stream of frames from this peer to the next peer ``peer_id``, with one reader task
    (``_read``, the subclass's) and writes one at a time; ``broken`` once the stream ended."""

    def __init__(self, peer_id: PeerId, stream: Stream, limits: FrameLimits):
        self.peer_id, self.stream = peer_id, stream
        # no per-frame timeout here: the forwarder times what it sends (call_timeout_s)
        self.frames = SessionStream(peer_id, limits, timeout_s=float("inf"), stream=stream)
        self._write_lock = asyncio.Lock()
        self._broken: Optional[BaseException] = None
        self._reader = asyncio.create_task(self._read())

    @property
    def broken(self) -> bool:
        """Whether the stream ended (what waited on it failed)."""
        return self._broken is not None

    async def _read(self) -> None:
        raise NotImplementedError


class PushLink(StreamLink):
    """This peer's stream to ``peer_id`` for ``session``: ``await send(msg, payload)`` returns a
    future of the reply (decoded) to that frame; ``on_unsolicited(reply)`` gets an ErrorReply
    that answers no pending frame, and ``on_broken(exc)`` the end of the stream, unless ``close``
    ended it."""

    def __init__(self, peer_id: PeerId, stream: Stream, session, limits: FrameLimits):
        self.session = session
        self.later: frozenset[str] = frozenset()  # the hops after ``peer_id`` (a relayed blame must name one)
        self.on_unsolicited: Callable[[ErrorReply], None] = lambda reply: None
        self.on_broken: Callable[[BaseException], None] = lambda exc: None
        self._pending: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        super().__init__(peer_id, stream, limits)

    async def send(self, msg, payload: bytes, step: int) -> asyncio.Future:
        """Write ``msg`` (for ``step``); the future of its reply. ConnectionError when broken."""
        if self._broken is not None:
            raise ConnectionError(f"link to {self.peer_id} is down: {self._broken!r}")
        if len(self._pending) >= MAX_PENDING:
            raise P2PServeError(f"{self.peer_id} left {MAX_PENDING} pushed steps unanswered")
        future = asyncio.get_running_loop().create_future()
        self._pending.append((step, future))
        async with self._write_lock:
            await self.frames.send(msg, payload)
        return future

    async def _read(self) -> None:
        """Match each reply to the oldest frame awaiting one; fail them all when the stream ends."""
        try:
            while True:
                reply, _ = await self.frames.read()  # raises MalformedFrameError: the link ends
                # an error naming no step (a refused frame) answers the oldest frame; one naming
                # another step reports a later failure of a step already acked
                if isinstance(reply, ErrorReply) and reply.step is not None and (
                        not self._pending or reply.step != self._pending[0][0]):
                    self.on_unsolicited(reply)  # a later failure of a step already acked: the link is done
                    raise ConnectionError(f"{self.peer_id} reported a later failure: {reply.message}")
                if not self._pending:
                    raise ConnectionError(f"{self.peer_id} sent a {type(reply).__name__} nothing asked for")
                _, future = self._pending.popleft()
                if not future.done():
                    future.set_result(reply)
        except asyncio.CancelledError:
            self._fail(ConnectionError(f"link to {self.peer_id} closed"))
            raise
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            self._fail(ConnectionError(f"{self.peer_id} closed the stream ({type(e).__name__})"))
            self.on_broken(self._broken)
        except Exception as e:  # a malformed frame, or the transport's own error: the link is gone
            self._fail(e)
            self.on_broken(e)

    def _fail(self, exc: BaseException) -> None:
        if self._broken is not None:
            return
        self._broken = exc
        while self._pending:
            _, future = self._pending.popleft()
            if not future.done():
                future.set_exception(exc)
        self.stream.close()

    def close(self) -> None:
        """Close the stream; pending frames fail with ConnectionError."""
        self._reader.cancel()
        if self._broken is None:
            self._fail(ConnectionError(f"link to {self.peer_id} closed"))


async def tell(writer, reply) -> None:
    """Best effort: a ring step's later failure, or a batch's ack, to the peer that pushed it
    (on the stream it came on, whose handler writes whole frames too)."""
    try:
        await write_frame(writer, reply)
    except Exception as e:  # that peer is gone too: the owner's timeout covers it
        log.info("could not tell the peer upstream: %r", e)
