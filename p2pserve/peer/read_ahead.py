"""Reading a stream on while one of its requests waits, so that a client's hang-up is seen.

A peer answers a stream's frames one at a time, and frees the stream's sessions when the stream
ends. An ``AwaitResult`` may wait long (a ring step that never comes waits ``wait_timeout_s``),
and meanwhile nobody reads the stream: a client that gave up (its ``CloseSession`` queued behind
the wait, then the stream closed) would hold its sessions' KV here until the wait timed out.

So while such a request waits, :meth:`ReadAhead.race` reads the frames queued behind it: whole
frames without a payload (``AwaitResult``, ``CloseSession``: a header of at most
``max_header_bytes``, at most ``max_frames`` of them) are kept to be served next, in order; the
end of the stream ends the wait (the request is not answered, and the stream ends). A frame with
a payload, or a prefix the limits refuse, stops the reading: its prefix is kept, and the normal
path reads (or refuses) the rest once the wait is over. Reads are cancel-safe: a read cut short
leaves its bytes in the reader.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Awaitable, Optional, TypeVar

from p2pserve.errors import P2PServeError
from p2pserve.protocol import FRAME_PREFIX, FrameLimits, check_prefix

T = TypeVar("T")

#: Frames read ahead at most: a ring client asks at most a couple of steps ahead.
MAX_FRAMES = 8


class ReadAhead:
    """One stream's frames read ahead of their turn; ``hung_up`` once its end was read."""

    def __init__(self, reader: asyncio.StreamReader, limits: FrameLimits, max_frames: int = MAX_FRAMES):
        self.reader = reader
        self.limits = limits
        self.max_frames = max_frames
        self.prefix: Optional[bytes] = None  # a frame's prefix read, its header not yet
        self.frames: collections.deque[tuple[bytes, bytes]] = collections.deque()  # (prefix, header)
        self.hung_up = False

    def take(self) -> tuple[Optional[bytes], Optional[bytes]]:
        """The next frame's prefix and header as far as they were read ahead (None: not read)."""
        if self.frames:
            return self.frames.popleft()
        prefix, self.prefix = self.prefix, None
        return prefix, None

    async def race(self, work: Awaitable[T]) -> Optional[T]:
        """``work``'s result, reading the stream on meanwhile; None (``work`` cancelled) if the
        client hung up first."""
        task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(self._watch())
        try:
            await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and self.hung_up:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return None
            return await task  # the watch stopped reading (or is stopped below): the wait goes on
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)

    async def _watch(self) -> None:
        """Read whole frames without a payload until the stream ends (``hung_up``), a frame with
        a payload or a refused prefix is next, or ``max_frames`` are held."""
        try:
            while len(self.frames) < self.max_frames:
                if self.prefix is None:
                    self.prefix = await self.reader.readexactly(FRAME_PREFIX.size)
                try:
                    header_len, payload_len = check_prefix(self.prefix, self.limits)
                except P2PServeError:
                    return  # the normal path refuses it, in its turn
                if payload_len:
                    return
                header = await self.reader.readexactly(header_len)
                self.frames.append((self.prefix, header))
                self.prefix = None
        except (asyncio.IncompleteReadError, ConnectionError):
            self.hung_up = True
