"""An impostor at an address the client dials first gets no byte of session data.

A real peer process serves the tiny Llama on 127.0.0.1. Two impostors listen at its direct port
on other loopback addresses, and the client's multiaddr list names them first (as a forged
record would): one completes TLS with a certificate of its own, one answers the old clear-text
``DirectAttached`` in the peer's name. Before the direct path was pinned, the first address
received ``AttachDirect`` with the token, ``OpenSession`` and every Forward, in clear.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from p2pserve.client.connection import HopConnection
from p2pserve.client.generation import generate
from p2pserve.client.hop import Hop
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.client.params import GenerationParams
from p2pserve.config import ClientConfig
from p2pserve.protocol import DirectOffer, OpenDirect
from p2pserve.transport.libp2p import Libp2pTransport
from p2pserve.transport.tcp import DirectTransport
from p2pserve.transport.tls import is_fingerprint
from tests.direct_impostor import CLIENT_HELLO, HANDSHAKE, Impostor, tls_records
from tests.harness import open_chain_pipeline, reference_generate, start_peers

pytestmark = pytest.mark.integration

GREEDY = GenerationParams(max_new_tokens=16, ignore_eos=True)
CONFIG = ClientConfig()


class RecordingTransport(DirectTransport):
    """The client's real transport, keeping the streams it hands out (to see where they went)."""

    def __init__(self, inner):
        super().__init__(inner, CONFIG.frame_limits, CONFIG.direct_connect_timeout_s)
        self.opened = []

    async def open_stream(self, peer_id, maddrs, protocol, timeout_s):
        stream = await super().open_stream(peer_id, maddrs, protocol, timeout_s)
        self.opened.append(stream)
        return stream


@pytest.fixture(scope="module")
def peer(model_dir):
    path = model_dir("llama")
    (p,) = start_peers(path, [(0, 8)])
    yield path, p
    p.stop()


async def direct_port(inner, p) -> int:
    """The peer's direct port, asked over libp2p (what an impostor learns from any offer)."""
    conn = HopConnection(inner, p.hop(), CONFIG.frame_limits, 30)
    await conn.connect()
    try:
        offer, _ = await conn.call(OpenDirect())
    finally:
        await conn.close()
    assert isinstance(offer, DirectOffer) and offer.port > 0 and is_fingerprint(offer.tls_sha256)
    return offer.port


def forged_first(p, hosts: list[str]) -> Hop:
    """The peer's hop with ``hosts`` listed before its own addresses."""
    port = p.maddrs[0].split("/")[4]
    forged = tuple(f"/ip4/{h}/tcp/{port}/p2p/{p.peer_id}" for h in hosts)
    return Hop(p.peer_id, 0, 8, forged + tuple(p.maddrs))


def test_impostors_listed_first_get_no_session_data_and_output_matches_generate(peer):
    path, p = peer
    model = LocalModelInfo.load(path)
    ids = model.chat_ids([{"role": "user", "content": "Hello! How are you today?"}])
    ref = reference_generate(path, ids, GREEDY.max_new_tokens)

    async def main():
        inner = await Libp2pTransport.create()
        transport = RecordingTransport(inner)
        port = await direct_port(inner, p)
        fakes = [await Impostor("127.0.0.2", port, p.peer_id, tls=True).start(),
                 await Impostor("127.0.0.3", port, p.peer_id, tls=False).start()]
        try:
            hop = forged_first(p, ["127.0.0.2", "127.0.0.3"])
            pipeline = await open_chain_pipeline(transport, [hop], model, 256, GREEDY, CONFIG)
            try:
                tokens = (await generate(pipeline, ids, GREEDY, model.eos_ids)).tokens
                where = [(s.kind, (s.writer.get_extra_info("peername") or ("",))[0]) for s in transport.opened]
            finally:
                await pipeline.close()
            return tokens, where, fakes
        finally:
            for fake in fakes:
                await fake.stop()
            await transport.close()

    tokens, where, (tls_fake, plain_fake) = asyncio.run(main())
    assert tokens[: len(ref)] == ref
    assert where and all(w == ("direct", "127.0.0.1") for w in where)  # the genuine address, pinned
    # Every session stream dialled both impostors first; each got a handshake and nothing of ours.
    assert len(tls_fake.raw) == len(plain_fake.raw) == len(where)
    assert all(plain == b"" for plain in tls_fake.plain)  # TLS with its own certificate: no application data
    for raw in tls_fake.raw + plain_fake.raw:
        handshake = tls_records(bytes(raw))[0]
        assert handshake[0] == HANDSHAKE and handshake[1][0] == CLIENT_HELLO
        for tag in ("attach_direct", "open", "forward"):  # a frame header holds {"t": tag, ...}
            assert msgspec.msgpack.encode({"t": tag})[1:] not in raw
    for raw in plain_fake.raw:  # the clear-text impostor broke the handshake: one ClientHello, nothing more
        assert len(tls_records(bytes(raw))) == 1
