"""Many session streams on one direct TLS connection, their writes coalesced per event-loop turn.

Why: a peer stepping 32 sessions answers each with its own frame in the same event-loop turn,
and a client asks each of them for its next token in one turn too. On a connection per stream,
each frame was its own TLS record and its own ``send``, which also woke the reader's process: on
a 2-core machine shared by the peer, the API and the load, those per-frame system calls and
wake-ups were the largest part of both event loops' time, and the compute threads lost the cores
to them. On one connection the frames written in a turn leave as one write, and a new stream
costs no libp2p stream, no TLS handshake and no round trip.

Layout on the connection, after the attach handshake (``AttachDirect(mux=True)`` answered by
``DirectAttached(mux=True)``, ``transport/tcp.py``): chunks of ``CHUNK`` (channel id, kind,
length) and ``length`` bytes. The client opens channels (``OPEN``, odd ids, increasing: an id is
never reused); either side sends ``DATA`` and ends a channel with ``CLOSE``. A channel is one
:class:`~p2pserve.transport.Stream`: its bytes carry the session protocol's frames as a
connection of their own did, and the peer serves each one with the same handler, as the same
client (the connection's token bound it to the client's peer id).

Hostile input: a chunk longer than ``MAX_CHUNK``, an unknown kind, an ``OPEN`` of an id already
used or beyond ``max_channels`` open, or a client's ``OPEN`` of an even id, ends the whole
connection (it is out of sync or abusive). ``DATA`` or ``CLOSE`` for a channel no longer open is
dropped (a race with a close). A channel whose unread bytes pass twice ``channel_limit`` pauses
the connection's reading until its reader takes them (the bound a socket's window gave a
connection per stream), so what one side buffers for the other is bounded by channels times that
limit. The accepting side closes a connection that has had no channel open for
``idle_timeout_s`` (the peer's listener: 300 s), as a stream's idle timeout closed its connection.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import threading
from typing import Awaitable, Callable, Optional

from p2pserve.transport import Stream

log = logging.getLogger(__name__)

CHUNK = struct.Struct(">IBI")  # channel id, kind, length
OPEN, DATA, CLOSE = 0, 1, 2
MAX_CHUNK = 64 * 1024  # a longer write goes as several chunks
#: Queued output past this is written at once by ``drain`` (and waited for, if the socket is full).
FLUSH_BYTES = 256 * 1024


class MuxError(ConnectionError):
    """The other side broke the multiplexing protocol; the connection is closed."""


class _Flow:
    """What a channel's ``StreamReader`` calls its transport: over its limit it pauses the
    connection's reading, under it again it resumes it (``StreamReader.set_transport``)."""

    def __init__(self, conn: "MuxConnection", channel: int):
        self.conn = conn
        self.channel = channel

    def pause_reading(self) -> None:
        self.conn._paused.add(self.channel)
        self.conn._resumed.clear()

    def resume_reading(self) -> None:
        self.conn._paused.discard(self.channel)
        if not self.conn._paused:
            self.conn._resumed.set()


class ChannelWriter:
    """The writing end of one channel, with the ``asyncio.StreamWriter`` methods frames use."""

    def __init__(self, conn: "MuxConnection", channel: int):
        self.conn = conn
        self.channel = channel
        self.closed = False

    def write(self, data) -> None:
        """Queue ``data`` for this turn's write of the connection (dropped once closed)."""
        if not self.closed and not self.conn.closed:
            self.conn._queue(self.channel, DATA, data)

    async def drain(self) -> None:
        """Raise ConnectionResetError once the channel or its connection is closed; write the
        queue at once when it is large, and wait while the socket is full."""
        if self.closed or self.conn.closed:
            raise ConnectionResetError("stream closed")
        if self.conn._pending >= FLUSH_BYTES:
            self.conn._flush()
            await self.conn.writer.drain()

    def close(self) -> None:
        """End the channel: the other side reads its end. Callable from any thread (a stream is
        closed from wherever its owner lets it go), the rest on the connection's loop only."""
        if threading.get_ident() != self.conn._thread:
            self.conn._loop.call_soon_threadsafe(self.close)
            return
        if not self.closed:
            self.closed = True
            self.conn._end(self.channel, tell=True)

    def unsent_bytes(self) -> int:
        """Bytes queued on the connection (any channel's) that its socket has not taken yet."""
        transport = getattr(self.conn.writer, "transport", None)
        return self.conn._pending + (transport.get_write_buffer_size() if transport is not None else 0)

    def is_closing(self) -> bool:
        """Whether the channel or its connection is closed."""
        return self.closed or self.conn.closed

    async def wait_closed(self) -> None:
        """Nothing to wait for: a channel's end is one chunk."""

    def get_extra_info(self, name: str, default=None):
        """The connection's (``peername``, ``ssl_object``, ...)."""
        return self.conn.writer.get_extra_info(name, default)


#: Serves one channel the peer side accepted: ``handler(reader, writer)``.
ChannelHandler = Callable[[asyncio.StreamReader, ChannelWriter], Awaitable[None]]


class MuxConnection:
    """One side of a multiplexed connection over ``reader``/``writer`` (the TLS stream after
    attaching). ``client``: this side opens channels (:meth:`open`); else each channel the other
    side opens is served by ``accept`` (set before :meth:`start`)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, client: bool,
                 accept: Optional[ChannelHandler] = None, channel_limit: int = 64 * 1024,
                 max_channels: int = 1024, idle_timeout_s: Optional[float] = None):
        self.reader = reader
        self.writer = writer
        self.client = client
        self.accept = accept
        self.channel_limit = channel_limit
        self.max_channels = max_channels
        # the accepting side closes a connection with no channel open for this long (a client
        # gone without a word would otherwise hold it for good, as its streams' own timeouts did)
        self.idle_timeout_s = idle_timeout_s
        self.closed = False
        self._readers: dict[int, asyncio.StreamReader] = {}
        self._writers: dict[int, ChannelWriter] = {}
        self._next_id = 1  # the client's next channel id (odd)
        self._highest = 0  # the highest id opened so far (ids are never reused)
        self._out: list[bytes | bytearray | memoryview] = []
        self._pending = 0
        self._flush_scheduled = False
        self._paused: set[int] = set()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._tasks: set[asyncio.Task] = set()
        self._reading: Optional[asyncio.Task] = None
        self._loop = asyncio.get_running_loop()  # built on the loop that serves it
        self._thread = threading.get_ident()

    @property
    def channels(self) -> int:
        """Channels open now."""
        return len(self._readers)

    def start(self) -> "MuxConnection":
        """Start reading the connection (a task); returns self."""
        self._reading = asyncio.ensure_future(self._read_loop())
        return self

    async def serve(self) -> None:
        """Read the connection until it ends (the peer side serves it on its own task)."""
        await self._read_loop()

    def open(self, kind: str = "direct") -> Stream:
        """A new channel to the other side, as a Stream (client side; ConnectionError once closed)."""
        if self.closed:
            raise ConnectionResetError("connection closed")
        channel, self._next_id = self._next_id, self._next_id + 2
        self._highest = channel
        reader = self._new_channel(channel)
        self._queue(channel, OPEN, b"")
        return Stream(reader, self._writers[channel], kind)

    def close(self) -> None:
        """Close the connection and every channel on it."""
        if self.closed:
            return
        self.closed = True
        for channel in list(self._readers):
            self._end(channel, tell=False)
        if self._out:
            try:
                self.writer.write(b"".join(self._out))
            except Exception:  # a transport torn down under us; closing is best effort
                pass
            self._out.clear()
        try:
            self.writer.close()
        except Exception:  # a transport torn down under us; closing is best effort
            pass
        for task in list(self._tasks):
            task.cancel()
        self._resumed.set()

    # ------------------------------------------------------------------ internals
    def _new_channel(self, channel: int) -> asyncio.StreamReader:
        reader = asyncio.StreamReader(limit=self.channel_limit)
        reader.set_transport(_Flow(self, channel))  # type: ignore[arg-type]  # pause/resume only
        self._readers[channel] = reader
        self._writers[channel] = ChannelWriter(self, channel)
        return reader

    def _queue(self, channel: int, kind: int, data) -> None:
        view = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else data
        for at in range(0, max(len(view), 1), MAX_CHUNK):
            part = view[at: at + MAX_CHUNK]
            self._out.append(CHUNK.pack(channel, kind, len(part)))
            if len(part):
                self._out.append(part)
            self._pending += CHUNK.size + len(part)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Write everything queued as one write (one TLS record run, one send)."""
        self._flush_scheduled = False
        if not self._out or self.closed:
            self._out.clear()
            self._pending = 0
            return
        data = b"".join(self._out)
        self._out.clear()
        self._pending = 0
        try:
            self.writer.write(data)
        except Exception as e:  # the transport is gone: every channel ends
            log.debug("mux write failed: %s", e)
            self.close()

    def _end(self, channel: int, tell: bool) -> None:
        """Forget ``channel`` (its reader reads its end); ``tell``: send CLOSE to the other side."""
        reader = self._readers.pop(channel, None)
        writer = self._writers.pop(channel, None)
        if reader is None:
            return
        self._paused.discard(channel)
        if not self._paused:
            self._resumed.set()
        reader.feed_eof()
        if writer is not None:
            writer.closed = True
        if tell and not self.closed:
            self._queue(channel, CLOSE, b"")

    async def _read_loop(self) -> None:
        try:
            while not self.closed:
                if self._paused:
                    await self._resumed.wait()
                    continue
                idle = self.idle_timeout_s if not self._readers else None
                async with asyncio.timeout(idle):
                    head = await self.reader.readexactly(CHUNK.size)
                channel, kind, length = CHUNK.unpack(head)
                if length > MAX_CHUNK or kind not in (OPEN, DATA, CLOSE):
                    raise MuxError(f"bad chunk (kind {kind}, {length} bytes)")
                data = await self.reader.readexactly(length) if length else b""
                if kind == OPEN:
                    self._opened(channel, data)
                elif kind == DATA:
                    reader = self._readers.get(channel)
                    if reader is not None:
                        reader.feed_data(data)
                elif channel in self._readers:
                    self._end(channel, tell=False)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, TimeoutError) as e:
            log.debug("mux connection ended: %r", e)
        finally:
            self.close()

    def _opened(self, channel: int, data: bytes) -> None:
        if self.client or channel % 2 == 0 or channel <= self._highest or data:
            raise MuxError(f"channel {channel} may not be opened here")
        if len(self._readers) >= self.max_channels:
            raise MuxError(f"more than {self.max_channels} channels open")
        assert self.accept is not None, "the accepting side is given its handler"
        self._highest = channel
        reader = self._new_channel(channel)
        writer = self._writers[channel]
        task = asyncio.ensure_future(self._serve_channel(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve_channel(self, reader: asyncio.StreamReader, writer: ChannelWriter) -> None:
        assert self.accept is not None
        try:
            await self.accept(reader, writer)
        except Exception:  # a handler's failure ends its channel only
            log.exception("a multiplexed stream's handler failed")
        finally:
            writer.close()
