"""Bad input gets a typed error, and the peer keeps serving every other session."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import msgspec
import pytest
import torch

from p2pserve.client.connection import HopConnection
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.client.node import client_transport
from p2pserve.config import ClientConfig
from p2pserve.errors import (
    BadRequestError,
    ErrorCode,
    OverloadedError,
    ModelMismatchError,
    SessionNotFoundError,
)
from p2pserve.protocol import FRAME_PREFIX, ErrorReply, Forward, SamplingParams, TensorMeta, decode_reply
from p2pserve.transport.frames import read_frame, write_frame
from tests.harness import start_peers

pytestmark = pytest.mark.integration

KV_SLOTS = 8 * 300  # room for two sessions of max_length 128 over 8 layers, not three
LIMITS = ClientConfig().frame_limits


@pytest.fixture(scope="module")
def peer(model_dir):
    path = model_dir("llama")
    (p,) = start_peers(path, [(0, 8)], "--kv-token-layers", str(KV_SLOTS), "--session-idle-timeout", "1.5", "--max-kv-fraction-per-owner", "1",
                       "--max-payload-mb", "1")
    yield path, p
    p.stop()


def run(coro):
    return asyncio.run(coro)


async def with_transport(fn, direct: bool = True):
    transport = await client_transport(ClientConfig(direct=direct))
    try:
        return await fn(transport)
    finally:
        await transport.close()


async def open_conn(transport, peer, model, start=0, end=8, max_length=128, sid="s"):
    conn = HopConnection(transport, peer.hop(start, end), LIMITS, 30)
    await conn.open(model.spec.model_id, sid, max_length, SamplingParams())
    return conn


async def healthy(transport, peer, model) -> bool:
    """A fresh session on the peer still produces a token."""
    conn = await open_conn(transport, peer, model, sid="healthy")
    reply, _ = await conn.forward(0, 0, torch.tensor([5, 6, 7]))
    await conn.close()
    return reply.token is not None


async def raw_error(conn: HopConnection, raw: bytes) -> ErrorReply:
    conn.stream.writer.write(raw)
    await conn.stream.writer.drain()
    header, _ = await read_frame(conn.stream.reader, LIMITS)
    reply = decode_reply(header)
    assert isinstance(reply, ErrorReply)
    return reply


def test_malformed_frame_gets_typed_error_and_stream_survives(peer):
    path, p = peer
    model = LocalModelInfo.load(path)

    async def main(transport):
        conn = await open_conn(transport, p, model)
        garbage = b"\xc1\xff not msgpack"
        reply = await raw_error(conn, FRAME_PREFIX.pack(len(garbage), 0) + garbage)
        assert reply.code == ErrorCode.MALFORMED.value
        # A well-formed map with missing fields is malformed too.
        bad = msgspec.msgpack.encode({"t": "forward", "session_id": "s"})
        reply = await raw_error(conn, FRAME_PREFIX.pack(len(bad), 0) + bad)
        assert reply.code == ErrorCode.MALFORMED.value
        # Same stream, same session: still works.
        result, _ = await conn.forward(0, 0, torch.tensor([1, 2, 3]))
        assert result.token is not None
        await conn.close()
        assert await healthy(transport, p, model)

    run(with_transport(main))


def test_wrong_hidden_size_or_dtype(peer):
    path, p = peer
    model = LocalModelInfo.load(path)
    H = model.spec.hidden_size

    async def main(transport):
        conn = await open_conn(transport, p, model, start=4, end=8)
        with pytest.raises(BadRequestError, match="hidden states must be"):
            await conn.forward(0, 0, torch.zeros(3, H + 1))
        with pytest.raises(BadRequestError, match="float32"):
            await conn.forward(0, 0, torch.zeros(3, H, dtype=torch.float16))
        with pytest.raises(BadRequestError, match="token ids"):
            first = await open_conn(transport, p, model, sid="ids")
            await first.forward(0, 0, torch.zeros(3, H))
        # A header whose byte count disagrees with its shape is rejected as malformed.
        meta = TensorMeta(dtype="float32", shape=[3, H], nbytes=12)
        await write_frame(conn.stream.writer, Forward(session_id="s", step=1, position=0, tensor=meta), b"x" * 12)
        header, _ = await read_frame(conn.stream.reader, LIMITS)
        reply = decode_reply(header)
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.MALFORMED.value
        assert "needs 768 bytes" in reply.message
        ok, _ = await conn.forward(2, 0, torch.zeros(3, H))
        assert ok.token is not None
        await conn.close()

    run(with_transport(main))


def test_oversized_payload_is_refused_before_allocation(peer):
    path, p = peer
    model = LocalModelInfo.load(path)

    async def main(transport):
        conn = await open_conn(transport, p, model)
        header = msgspec.msgpack.encode(
            Forward(session_id="s", step=0, position=0, tensor=TensorMeta("float32", [10**6, 64], 256 * 10**6))
        )
        # Claims a 256 MB payload against a 1 MB limit; no payload bytes are ever sent.
        reply = await raw_error(conn, FRAME_PREFIX.pack(len(header), 256 * 10**6) + header)
        assert reply.code == ErrorCode.TOO_LARGE.value
        assert await healthy(transport, p, model)

    run(with_transport(main))


def test_unknown_and_expired_sessions(peer):
    path, p = peer
    model = LocalModelInfo.load(path)

    async def main(transport):
        conn = await open_conn(transport, p, model, sid="will-expire")
        await conn.forward(0, 0, torch.tensor([1, 2]))
        await asyncio.sleep(4.0)  # idle timeout is 1.5 s; the reaper runs every ~0.4 s
        with pytest.raises(SessionNotFoundError, match="expired"):
            await conn.forward(1, 2, torch.tensor([3]))
        conn.session_id = "never-opened"
        with pytest.raises(SessionNotFoundError, match="unknown session"):
            await conn.forward(0, 0, torch.tensor([3]))
        await conn.close()
        assert await healthy(transport, p, model)

    run(with_transport(main))


def test_layers_outside_range_and_unknown_model(peer):
    path, p = peer
    model = LocalModelInfo.load(path)

    async def main(transport):
        conn = HopConnection(transport, p.hop(0, 9), LIMITS, 30)
        with pytest.raises(BadRequestError, match="outside this peer's range"):
            await conn.open(model.spec.model_id, "x", 64, SamplingParams())
        await conn.close()
        conn = HopConnection(transport, p.hop(0, 8), LIMITS, 30)
        with pytest.raises(ModelMismatchError) as info:
            await conn.open("no-such-model-123", "y", 64, SamplingParams())
        assert info.value.code == ErrorCode.UNKNOWN_MODEL
        await conn.close()
        assert await healthy(transport, p, model)

    run(with_transport(main))


def test_peer_with_missing_model_exits_with_clear_error(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "p2pserve.cli", "peer", "--model", str(tmp_path / "nope"), "--layers", "0:1"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2
    assert "does not exist" in out.stderr


def test_exhausted_kv_budget_is_overloaded_and_others_continue(peer):
    path, p = peer
    model = LocalModelInfo.load(path)

    async def main(transport):
        # KV is paged: sessions take 16-token blocks as they grow. a and b hold 8 blocks of each
        # of 8 layers (2 x 1024 of 2400 token-layers), c its one-block headroom (128): c's prompt
        # of 100 (7 blocks per layer, 768 more) finds the pool full.
        a = await open_conn(transport, p, model, sid="a")
        b = await open_conn(transport, p, model, sid="b")
        for first, conn in ((1, a), (2, b)):  # other prompts: equal ones would share their blocks
            await conn.forward(0, 0, torch.arange(first, first + 120))
        c = await open_conn(transport, p, model, sid="c")
        with pytest.raises(OverloadedError, match="KV cache full"):
            await c.forward(0, 0, torch.arange(1, 101))
        r, _ = await a.forward(1, 120, torch.tensor([1, 2, 3]))  # within a's blocks: served
        assert r.token is not None
        await b.close()  # gives its blocks back: c's prompt now fits
        r, _ = await c.forward(1, 0, torch.arange(1, 101))
        assert r.token is not None
        await a.close()
        await c.close()

    run(with_transport(main))


def test_direct_path_refuses_bad_attach_and_keeps_serving(peer):
    """The direct TLS port takes only a fresh token from an OpenDirect; anything else is closed."""
    from p2pserve.protocol import AttachDirect, DirectAttached, DirectOffer, OpenDirect
    from p2pserve.transport.tls import check_pin, client_context

    path, p = peer
    model = LocalModelInfo.load(path)

    async def attach(offer: DirectOffer, first_frame: bytes):
        reader, writer = await asyncio.open_connection("127.0.0.1", offer.port, ssl=client_context())
        check_pin(writer.get_extra_info("ssl_object"), offer.tls_sha256, "the peer's direct port")
        writer.write(first_frame)
        await writer.drain()
        try:
            header, _ = await asyncio.wait_for(read_frame(reader, LIMITS), 10)
            return decode_reply(header)
        except asyncio.IncompleteReadError:
            return None  # closed without a reply
        finally:
            writer.close()

    def frame(msg) -> bytes:
        body = msgspec.msgpack.encode(msg)
        return FRAME_PREFIX.pack(len(body), 0) + body

    async def main(transport):
        conn = HopConnection(transport, p.hop(), LIMITS, 30)
        await conn.connect()
        assert conn.stream.kind == "libp2p"
        offer, _ = await conn.call(OpenDirect())
        assert isinstance(offer, DirectOffer) and offer.port > 0 and offer.token
        garbage = b"\xc1 not msgpack"
        assert await attach(offer, FRAME_PREFIX.pack(len(garbage), 0) + garbage) is None
        assert await attach(offer, FRAME_PREFIX.pack(1 << 20, 0)) is None  # oversized header
        assert await attach(offer, frame(AttachDirect(token="0" * 32))) is None  # never issued
        ok = await attach(offer, frame(AttachDirect(token=offer.token)))
        assert isinstance(ok, DirectAttached) and ok.peer_id == p.peer_id
        assert await attach(offer, frame(AttachDirect(token=offer.token))) is None  # single use
        await conn.close()
        assert await healthy(transport, p, model)

    run(with_transport(main, direct=False))  # the client keeps to libp2p: the test attaches by hand


def test_a_multiplexed_connection_out_of_protocol_is_closed_and_the_peer_keeps_serving(peer):
    """A client that attached with ``mux`` and then breaks the channel protocol (a channel id
    only the peer may use, a chunk past the size limit) loses that connection, nothing more."""
    from p2pserve.protocol import AttachDirect, DirectAttached, OpenDirect
    from p2pserve.transport.mux import CHUNK, DATA, MAX_CHUNK, OPEN
    from p2pserve.transport.tls import check_pin, client_context

    path, p = peer
    model = LocalModelInfo.load(path)

    async def attached(transport):
        conn = HopConnection(transport, p.hop(), LIMITS, 30)
        await conn.connect()
        offer, _ = await conn.call(OpenDirect())
        reader, writer = await asyncio.open_connection("127.0.0.1", offer.port, ssl=client_context())
        check_pin(writer.get_extra_info("ssl_object"), offer.tls_sha256, "the peer's direct port")
        body = msgspec.msgpack.encode(AttachDirect(token=offer.token, mux=True))
        writer.write(FRAME_PREFIX.pack(len(body), 0) + body)
        header, _ = await asyncio.wait_for(read_frame(reader, LIMITS), 10)
        ack = decode_reply(header)
        assert isinstance(ack, DirectAttached) and ack.mux
        await conn.close()
        return reader, writer

    async def closed_after(transport, raw: bytes) -> bool:
        reader, writer = await attached(transport)
        writer.write(raw)
        await writer.drain()
        try:
            async with asyncio.timeout(10):
                return await reader.read() == b""
        finally:
            writer.close()

    async def main(transport):
        assert await closed_after(transport, CHUNK.pack(2, OPEN, 0))  # even ids are the peer's
        assert await closed_after(transport, CHUNK.pack(1, OPEN, 0) + CHUNK.pack(1, DATA, MAX_CHUNK + 1))
        assert await healthy(transport, p, model)

    run(with_transport(main, direct=False))  # the client keeps to libp2p: the test attaches by hand


def test_another_client_cannot_drive_or_close_a_session(peer):
    """Knowing a session id is not enough to use it; only its own stream can."""
    from p2pserve.protocol import CloseSession

    path, p = peer
    model = LocalModelInfo.load(path)
    prompt = torch.tensor([11, 12, 13, 14])

    async def undisturbed(transport) -> list[int]:
        conn = await open_conn(transport, p, model, sid="reference")
        first, _ = await conn.forward(0, 0, prompt)
        second, _ = await conn.forward(1, 4, torch.tensor([first.token]))
        await conn.close()
        return [first.token, second.token]

    async def attack(sid: str) -> None:
        async def mallory(transport):  # a second, independent client node
            conn = HopConnection(transport, p.hop(0, 8), LIMITS, 30)
            await conn.connect()
            conn.session_id = sid
            with pytest.raises(SessionNotFoundError, match="unknown session"):
                await conn.forward(0, 4, torch.tensor([99]))
            with pytest.raises(SessionNotFoundError, match="unknown session"):
                await conn.call(CloseSession(session_id=sid))
            await conn.close()
        await with_transport(mallory)

    async def main(transport):
        want = await undisturbed(transport)
        victim = await open_conn(transport, p, model, sid="victim")
        first, _ = await victim.forward(0, 0, prompt)
        await attack("victim")
        second, _ = await victim.forward(1, 4, torch.tensor([first.token]))
        assert [first.token, second.token] == want
        closed, _ = await victim.call(CloseSession(session_id="victim"))
        assert closed.session_id == "victim"
        victim.session_id = None
        await victim.close()

    run(with_transport(main))


def test_closing_the_client_transport_closes_its_direct_connections(peer):
    """DirectTransport.close() left its direct TCP connections open: the peer kept serving them."""
    path, p = peer
    model = LocalModelInfo.load(path)

    async def main():
        transport = await client_transport(ClientConfig(direct=True))
        conn = await open_conn(transport, p, model, sid="direct-close")
        assert conn.stream.kind == "direct"
        await transport.close()
        async with asyncio.timeout(10):
            assert await conn.stream.reader.read() == b""  # our end is closed: EOF, no more replies

    run(main())
