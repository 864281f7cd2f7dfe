"""Streams multiplexed on one connection (transport/mux.py), over real loopback sockets: frames on
channels carry as on connections of their own, a turn's writes leave as one, and a hostile
side can neither break other channels nor make the other side buffer without bound."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from p2pserve.protocol import FrameLimits, GetStats
from p2pserve.transport.frames import read_frame, write_frame
from p2pserve.transport.mux import CHUNK, CLOSE, DATA, MAX_CHUNK, OPEN, MuxConnection


async def _echo(reader, writer):
    """Answer every frame with itself, until the channel ends."""
    try:
        while True:
            header, payload = await read_frame(reader, FrameLimits())
            writer.write(len(header).to_bytes(4, "big") + len(payload).to_bytes(8, "big") + header + payload)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass


@contextlib.asynccontextmanager
async def _server(accept=_echo, **kw):
    """A peer-side MuxConnection per accepted socket; yields (host, port, the connections)."""
    conns: list[MuxConnection] = []

    async def serve(reader, writer):
        conn = MuxConnection(reader, writer, client=False, accept=accept, **kw)
        conns.append(conn)
        await conn.serve()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[:2], conns
    finally:
        server.close()
        for conn in conns:
            conn.close()


class _CountingWriter:
    """A StreamWriter that counts its writes."""

    def __init__(self, inner):
        self.inner = inner
        self.writes = 0

    def write(self, data):
        self.writes += 1
        self.inner.write(data)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_channels_carry_frames_apart_and_a_turns_writes_leave_as_one():
    async def go():
        async with _server() as ((host, port), conns):
            reader, writer = await asyncio.open_connection(host, port)
            counting = _CountingWriter(writer)
            client = MuxConnection(reader, counting, client=True).start()  # type: ignore[arg-type]
            streams = [client.open() for _ in range(8)]
            for s in streams:  # one turn: eight opens and eight frames
                await write_frame(s.writer, GetStats(), b"x" * 10)
            await asyncio.sleep(0.05)
            assert counting.writes == 1
            for s in streams:
                header, payload = await read_frame(s.reader, FrameLimits())
                assert payload == b"x" * 10
            assert conns[0].channels == 8
            streams[0].close()  # one channel ends; the others go on
            await write_frame(streams[1].writer, GetStats(), b"y" * (3 * MAX_CHUNK))  # several chunks
            _, payload = await read_frame(streams[1].reader, FrameLimits())
            assert payload == b"y" * (3 * MAX_CHUNK)
            await asyncio.sleep(0.05)
            assert conns[0].channels == 7
            client.close()
            await asyncio.sleep(0.05)
            assert conns[0].closed  # the client's end ends every channel

    asyncio.run(go())


async def _raw(host, port, *chunks: tuple[int, int, bytes]):
    """Write raw chunks; True when the other side then closed the connection."""
    reader, writer = await asyncio.open_connection(host, port)
    for channel, kind, data in chunks:
        writer.write(CHUNK.pack(channel, kind, len(data)) + data)
    await writer.drain()
    try:
        async with asyncio.timeout(1.0):
            return await reader.read(1 << 16) == b"" or True
    except TimeoutError:
        return False
    finally:
        writer.close()


@pytest.mark.parametrize("chunks", [
    [(2, OPEN, b"")],  # only the client opens, with odd ids
    [(1, OPEN, b""), (1, OPEN, b"")],  # an id opened twice
    [(3, OPEN, b""), (1, OPEN, b"")],  # ids only increase
    [(1, OPEN, b"x")],  # an open carries nothing
    [(1, 7, b"")],  # no such kind
], ids=["even-id", "reopened", "lower-id", "open-with-data", "unknown-kind"])
def test_a_chunk_out_of_protocol_ends_that_connection_only(chunks):
    async def go():
        async with _server() as ((host, port), conns):
            assert await _raw(host, port, *chunks)
            await asyncio.sleep(0.05)
            assert conns[0].closed
            # another client's connection is served as ever
            reader, writer = await asyncio.open_connection(host, port)
            client = MuxConnection(reader, writer, client=True).start()
            s = client.open()
            await write_frame(s.writer, GetStats())
            await read_frame(s.reader, FrameLimits())
            client.close()

    asyncio.run(go())


def test_an_oversized_chunk_ends_the_connection_before_its_body_is_read():
    async def go():
        async with _server() as ((host, port), conns):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(CHUNK.pack(1, OPEN, 0) + CHUNK.pack(1, DATA, MAX_CHUNK + 1))
            await writer.drain()
            async with asyncio.timeout(2.0):
                assert await reader.read(1 << 16) == b""
            assert conns[0].closed
            writer.close()

    asyncio.run(go())


def test_data_or_a_close_for_a_channel_that_is_gone_is_dropped():
    async def go():
        async with _server() as ((host, port), conns):
            assert not await _raw(host, port, (1, OPEN, b""), (1, CLOSE, b""), (1, DATA, b"late"), (1, CLOSE, b""),
                                  (9, DATA, b"never opened"))
            assert not conns[0].closed

    asyncio.run(go())


def test_a_channel_nobody_reads_pauses_the_connection_instead_of_filling_memory():
    release = asyncio.Event()
    limit = 4096

    async def slow(reader, writer):
        await release.wait()  # reads nothing until told
        await _echo(reader, writer)

    async def go():
        async with _server(accept=slow, channel_limit=limit) as ((host, port), conns):
            reader, writer = await asyncio.open_connection(host, port)
            client = MuxConnection(reader, writer, client=True).start()
            flood = client.open()
            flood.writer.write(b"z" * (40 * limit))  # far past what the other side may hold for it
            await flood.writer.drain()
            await asyncio.sleep(0.2)
            held = conns[0]._readers[1]
            assert len(held._buffer) <= 2 * limit + MAX_CHUNK  # it stopped reading the connection
            other = client.open()
            await write_frame(other.writer, GetStats())
            with pytest.raises(TimeoutError):  # the other channel waits behind the paused one
                async with asyncio.timeout(0.2):
                    await read_frame(other.reader, FrameLimits())
            release.set()  # the slow reader reads (and refuses the junk): the connection reads on
            async with asyncio.timeout(5.0):
                await read_frame(other.reader, FrameLimits())
            client.close()

    asyncio.run(go())


def test_the_accepting_side_closes_a_connection_left_without_channels():
    async def go():
        async with _server(idle_timeout_s=0.3) as ((host, port), conns):
            reader, writer = await asyncio.open_connection(host, port)
            client = MuxConnection(reader, writer, client=True).start()
            s = client.open()
            await asyncio.sleep(0.6)  # a channel is open: the connection stays, however quiet
            assert not conns[0].closed
            s.close()
            await asyncio.sleep(0.6)
            assert conns[0].closed and client.closed

    asyncio.run(go())


def test_a_channel_closed_from_another_thread_ends_and_the_rest_go_on():
    import threading

    async def go():
        async with _server() as ((host, port), conns):
            reader, writer = await asyncio.open_connection(host, port)
            client = MuxConnection(reader, writer, client=True).start()
            gone, kept = client.open(), client.open()
            closer = threading.Thread(target=gone.close)  # as a test's or a library's thread does
            closer.start()
            closer.join()
            await write_frame(kept.writer, GetStats())
            async with asyncio.timeout(5.0):
                await read_frame(kept.reader, FrameLimits())
            await asyncio.sleep(0.05)
            assert conns[0].channels == 1
            client.close()

    asyncio.run(go())
