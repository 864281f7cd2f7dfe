"""The direct path's TLS pinning (``transport/tls.py``, ``transport/tcp.py``) on loopback sockets.

The peer side is the real ``DirectListener``; its "libp2p" side is an in-memory transport that
carries the offer (what libp2p authenticates in production). Impostors listen on other loopback
addresses (all of 127/8 is local on Linux) at the listener's port, listed before the genuine one.
"""

from __future__ import annotations

import asyncio
import ssl

import msgspec
import pytest

from p2pserve.errors import MalformedFrameError
from p2pserve.protocol import (
    SESSION_PROTOCOL,
    AttachDirect,
    DirectOffer,
    FrameLimits,
    GetStats,
    decode_reply,
    encode_frame,
)
from p2pserve.testing.direct import answer_direct_session
from p2pserve.transport.frames import read_frame, write_frame
from p2pserve.transport.memory import MemoryNetwork
from p2pserve.transport.tcp import DirectListener, DirectTransport
from p2pserve.transport.tls import (
    DirectTLS,
    check_pin,
    client_context,
    fingerprint,
    is_fingerprint,
)
from tests.direct_impostor import (
    APPLICATION_DATA,
    CLIENT_HELLO,
    HANDSHAKE,
    Impostor,
    tls_records,
)

GENUINE, IMPOSTOR, PLAIN_IMPOSTOR = "127.0.0.1", "127.0.0.2", "127.0.0.3"


def maddr(host: str) -> str:
    return f"/ip4/{host}/tcp/1/p2p/peerX"


async def _dial(hosts, impostors=(), offer_edit=None):
    """Start a listener on 127.0.0.1 and ``impostors`` (``(host, speaks_tls)``) at its port, open a
    session stream listing ``hosts`` in order; return (stream kind, peer address or None, who the
    peer served, the impostors)."""
    served: list[str] = []
    listener = DirectListener(lambda r, w, remote: answer_direct_session(r, w, None, remote, served), "peerX", [GENUINE])
    await listener.start()
    fakes = [await Impostor(h, listener.port, "peerX", tls).start() for h, tls in impostors]

    class Offers:  # what the peer's libp2p side answers OpenDirect with (edited by a test)
        def offer(self, remote):
            offer = listener.offer(remote)
            return offer_edit(offer) if offer_edit else offer

    net = MemoryNetwork()
    net.serve("peerX", SESSION_PROTOCOL, lambda r, w, remote: answer_direct_session(r, w, Offers(), remote))
    transport = DirectTransport(net.transport("client"))
    try:
        stream = await transport.open_stream("peerX", [maddr(h) for h in hosts], SESSION_PROTOCOL, 10.0)
        await write_frame(stream.writer, GetStats())
        header, _ = await read_frame(stream.reader, FrameLimits())
        assert decode_reply(header).message == "client"  # served as the client, on either path
        peer = stream.writer.get_extra_info("peername")
        stream.close()
        return stream.kind, peer[0] if peer else None, served, fakes
    finally:
        for fake in fakes:
            await fake.stop()
        await listener.stop()
        await transport.close()


def _only_a_client_hello(raw: bytes) -> bool:
    records = tls_records(raw)
    return len(records) == 1 and records[0][0] == HANDSHAKE and records[0][1][0] == CLIENT_HELLO


def test_an_impostor_listed_first_gets_no_session_data():
    kind, peer, served, (tls_fake, plain_fake) = asyncio.run(
        _dial([IMPOSTOR, PLAIN_IMPOSTOR, GENUINE], impostors=[(IMPOSTOR, True), (PLAIN_IMPOSTOR, False)]))
    assert (kind, peer, served) == ("direct", GENUINE, ["client"])
    # Both impostors were dialled first; each saw a handshake, and nothing else of ours.
    assert len(tls_fake.raw) == 1 and len(plain_fake.raw) == 1
    assert tls_fake.plain == [bytearray()]  # TLS completed with its own certificate: no application data
    assert tls_records(bytes(tls_fake.raw[0]))[0][1][0] == CLIENT_HELLO
    assert _only_a_client_hello(bytes(plain_fake.raw[0]))  # the clear-text answer broke the handshake
    for raw in (tls_fake.raw[0], plain_fake.raw[0]):
        assert b"attach_direct" not in raw and b"get_stats" not in raw


def test_an_offer_without_a_pin_keeps_the_stream_on_libp2p():
    """No fingerprint, a malformed one, or another certificate's: the token never leaves the
    authenticated stream, and the listener attaches nobody."""
    for edit in (lambda o: DirectOffer(port=o.port, token=o.token),
                 lambda o: msgspec.structs.replace(o, tls_sha256="not hex"),
                 lambda o: msgspec.structs.replace(o, tls_sha256="0" * 64)):
        kind, _, served, _ = asyncio.run(_dial([GENUINE], offer_edit=edit))
        assert kind == "memory" and served == []


def test_only_pinned_tls_13_endpoints_pass_check_pin():
    async def main():
        tls = DirectTLS.generate()
        server = await asyncio.start_server(lambda r, w: w.close(), GENUINE, 0, ssl=tls.context)
        port = server.sockets[0].getsockname()[1]
        try:
            _, writer = await asyncio.open_connection(GENUINE, port, ssl=client_context())
            obj = writer.get_extra_info("ssl_object")
            check_pin(obj, tls.fingerprint, "here")  # passes
            for wrong in (DirectTLS.generate().fingerprint, "", tls.fingerprint.upper(), tls.fingerprint[:-1]):
                with pytest.raises(ConnectionError, match="other than the one the peer pinned"):
                    check_pin(obj, wrong, "here")
            writer.close()
            with pytest.raises(ConnectionError, match="not a TLS connection"):
                check_pin(None, tls.fingerprint, "here")
            old = client_context()
            old.minimum_version = old.maximum_version = ssl.TLSVersion.TLSv1_2
            with pytest.raises(OSError):  # the listener speaks TLS 1.3 only (an alert, or a reset)
                await asyncio.open_connection(GENUINE, port, ssl=old)
        finally:
            server.close()

    asyncio.run(main())


def test_fingerprints_are_fresh_and_well_formed():
    a, b = DirectTLS.generate(), DirectTLS.generate()
    assert a.fingerprint != b.fingerprint and is_fingerprint(a.fingerprint)
    assert fingerprint(b"x") == "2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881"
    assert not is_fingerprint("A" * 64) and not is_fingerprint("a" * 63)


def test_offer_decoding_refuses_a_malformed_fingerprint():
    def header(**fields) -> bytes:
        return msgspec.msgpack.encode({"t": "direct_offer", "port": 1, "token": "t", **fields})

    assert decode_reply(header(tls_sha256="ab" * 32)).tls_sha256 == "ab" * 32
    assert decode_reply(header()).tls_sha256 == ""  # a peer without TLS: the client will not attach
    for bad in ("AB" * 32, "ab" * 31, "zz" * 32, "ab" * 33):
        with pytest.raises(MalformedFrameError):
            decode_reply(header(tls_sha256=bad))


def test_the_listener_refuses_a_clear_text_attach_and_offers_nothing_before_start():
    async def main():
        served = []
        listener = DirectListener(lambda r, w, remote: answer_direct_session(r, w, None, remote, served), "peerX", [GENUINE])
        assert listener.offer("client") == DirectOffer(port=0)  # not listening yet
        await listener.start()
        offer = listener.offer("client")
        try:
            reader, writer = await asyncio.open_connection(GENUINE, listener.port)  # no TLS
            writer.write(b"".join(bytes(p) for p in encode_frame(AttachDirect(token=offer.token))))
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, nothing answered
            writer.close()
        finally:
            await listener.stop()
        assert served == [] and len(listener.tokens) == 1  # never redeemed

    asyncio.run(main())


def test_records_after_the_handshake_are_encrypted():
    """What a passive observer sees of an attached session: TLS records, never a frame."""
    async def main():
        seen = bytearray()
        listener = DirectListener(lambda r, w, remote: answer_direct_session(r, w, None, remote), "peerX", [GENUINE])
        await listener.start()
        relay = await Impostor(IMPOSTOR, listener.port, "peerX", upstream=listener.port).start()
        net = MemoryNetwork()
        net.serve("peerX", SESSION_PROTOCOL, lambda r, w, remote: answer_direct_session(r, w, listener, remote))
        transport = DirectTransport(net.transport("client"))
        try:
            stream = await transport.open_stream("peerX", [maddr(IMPOSTOR)], SESSION_PROTOCOL, 10.0)
            assert stream.kind == "direct"
            await write_frame(stream.writer, GetStats())
            await read_frame(stream.reader, FrameLimits())
            stream.close()
            seen += relay.raw[0]  # the tap forwarded every byte of ours before the reply came back
        finally:
            await relay.stop()
            await listener.stop()
            await transport.close()
        records = tls_records(bytes(seen))
        assert any(t == APPLICATION_DATA for t, _ in records)
        assert b"attach_direct" not in seen and b"get_stats" not in seen

    asyncio.run(main())


def test_a_stream_the_peer_refuses_is_a_typed_error_not_a_stream_nothing_answers_on():
    """A peer at its stream bound answers the OpenDirect with ``overloaded`` and closes the stream
    (``SessionHandler._refuse_stream``): the dialler gets that error, typed (it used to get the
    libp2p stream back, on which its next request went unanswered until the peer closed it)."""
    from p2pserve.errors import ErrorCode, OverloadedError
    from p2pserve.protocol import error_reply

    async def refuse(reader, writer, remote):
        await read_frame(reader, FrameLimits())
        await write_frame(writer, error_reply(ErrorCode.OVERLOADED, "you already have 4 streams open to this peer"))
        writer.close()

    async def main():
        net = MemoryNetwork()
        net.serve("peerX", SESSION_PROTOCOL, refuse)
        transport = DirectTransport(net.transport("client"))
        try:
            with pytest.raises(OverloadedError, match="streams open"):
                await transport.open_stream("peerX", [maddr(GENUINE)], SESSION_PROTOCOL, 10.0)
        finally:
            await transport.close()

    asyncio.run(main())
