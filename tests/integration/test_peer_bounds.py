"""No single remote node can exhaust a real peer process: payloads, streams, sessions and KV.

Each attack reproduced against a peer process on 127.0.0.1:
- a Forward claiming a huge payload for a session that does not exist (or more than its session
  may legally send) was read in full before the session was looked up;
- a stalled frame and a silent stream were held forever;
- one node opening sessions as fast as it could filled the peer, and honest clients got
  "overloaded".
After each, an honest client (another node, so another owner) is served at once.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from p2pserve.client.connection import HopConnection
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.client.node import client_transport
from p2pserve.config import ClientConfig
from p2pserve.errors import ErrorCode, OverloadedError
from p2pserve.protocol import FRAME_PREFIX, Forward, SamplingParams, TensorMeta, decode_reply
from p2pserve.transport.frames import read_frame
from tests.harness import start_peers

pytestmark = pytest.mark.integration

LAYERS = 8
KV_SLOTS = LAYERS * 128 * 10  # ten sessions of max_length 128; one owner may hold half: five
LIMITS = ClientConfig().frame_limits
QUIET_S = 2.0  # the peer's --stream-idle-timeout and --frame-read-timeout


@pytest.fixture(scope="module")
def peer(model_dir):
    path = model_dir("llama")
    (p,) = start_peers(path, [(0, LAYERS)], "--kv-token-layers", str(KV_SLOTS), "--max-sessions-per-owner", "8",
                       "--max-streams-per-owner", "12", "--stream-idle-timeout", str(QUIET_S),
                       "--frame-read-timeout", str(QUIET_S))
    yield LocalModelInfo.load(path), p
    p.stop()


def run(coro):
    return asyncio.run(coro)


async def node():
    """A client node of its own: its own peer id, so its own owner on the peer."""
    return await client_transport(ClientConfig(direct=False))


async def session(transport, p, model, max_length=128) -> HopConnection:
    conn = HopConnection(transport, p.hop(0, LAYERS), LIMITS, 30)
    await conn.open(model.spec.model_id, None, max_length, SamplingParams())
    return conn


async def served(p, model) -> bool:
    """An honest node opens a session and gets a token, within 2 s."""
    transport = await node()
    try:
        async with asyncio.timeout(2.0):
            conn = await session(transport, p, model)
            reply, _ = await conn.forward(0, 0, torch.tensor([5, 6, 7]))
            await conn.close()
        return reply.token is not None
    finally:
        await transport.close()


async def reply_then_eof(conn: HopConnection, raw: bytes):
    """Send raw bytes; the peer's reply, and whether it then closed the stream."""
    conn.stream.writer.write(raw)
    await conn.stream.writer.drain()
    async with asyncio.timeout(10):
        header, _ = await read_frame(conn.stream.reader, LIMITS)
        rest = await conn.stream.reader.read()
    return decode_reply(header), rest == b""


def forward_header(session_id: str, n_tokens: int) -> bytes:
    meta = TensorMeta("int64", [n_tokens], 8 * n_tokens)
    return msgspec.msgpack.encode(Forward(session_id=session_id, step=0, position=0, tensor=meta))


def test_a_payload_is_refused_by_what_its_session_may_send_before_it_is_read(peer):
    model, p = peer

    async def main():
        transport = await node()
        try:
            # 200 MiB for a session that does not exist: answered before one payload byte is sent.
            conn = await session(transport, p, model)
            header = forward_header("nobody", 25 * 1024**2)
            reply, closed = await reply_then_eof(conn, FRAME_PREFIX.pack(len(header), 200 * 1024**2) + header)
            assert reply.code == ErrorCode.UNKNOWN_SESSION.value and closed
            # 1 MiB of token ids for a session of max_length 16 (128 bytes at most).
            conn = await session(transport, p, model, max_length=16)
            header = forward_header(conn.session_id, 128 * 1024)
            reply, closed = await reply_then_eof(conn, FRAME_PREFIX.pack(len(header), 1024**2) + header)
            assert reply.code == ErrorCode.TOO_LARGE.value and "may carry" in reply.message and closed
        finally:
            await transport.close()
        assert await served(p, model)

    run(main())


def test_a_stalled_frame_and_a_silent_stream_are_closed(peer):
    model, p = peer

    async def main():
        transport = await node()
        try:
            silent = HopConnection(transport, p.hop(0, LAYERS), LIMITS, 30)
            await silent.connect()
            stalled = await session(transport, p, model)
            header = forward_header(stalled.session_id, 3)
            stalled.stream.writer.write(FRAME_PREFIX.pack(len(header), 24) + header[:5])  # and nothing more
            await stalled.stream.writer.drain()
            async with asyncio.timeout(QUIET_S + 15):
                assert await silent.stream.reader.read() == b""  # EOF: the peer hung up
                assert await stalled.stream.reader.read() == b""
        finally:
            await transport.close()
        assert await served(p, model)

    run(main())


def test_one_node_cannot_take_every_session_or_the_kv(peer):
    model, p = peer

    async def main():
        transport = await node()
        held = []
        try:
            for _ in range(5):  # half the KV: five sessions grown to 128 positions (KV is taken as used)
                held.append(await session(transport, p, model))
                await held[-1].forward(0, 0, torch.arange(1, 129))
            with pytest.raises(OverloadedError, match="one client may hold"):
                await session(transport, p, model)
            assert await served(p, model)  # another node still gets a session
            for conn in held:
                await conn.close()
            held = [await session(transport, p, model, max_length=8) for _ in range(8)]
            with pytest.raises(OverloadedError, match="already hold 8 sessions"):
                await session(transport, p, model, max_length=8)
            assert await served(p, model)
        finally:
            for conn in held:
                await conn.close()
            await transport.close()

    run(main())


def test_one_node_cannot_take_every_stream(peer):
    model, p = peer

    async def main():
        transport = await node()
        streams = []
        try:
            for _ in range(12):
                conn = HopConnection(transport, p.hop(0, LAYERS), LIMITS, 30)
                await conn.connect()
                await conn.stats()  # served: the stream was admitted
                streams.append(conn)
            extra = HopConnection(transport, p.hop(0, LAYERS), LIMITS, 30)
            await extra.connect()
            with pytest.raises(OverloadedError, match="streams open"):
                await extra.stats()
            assert await served(p, model)
        finally:
            for conn in streams:
                await conn.close()
            await transport.close()

    run(main())
