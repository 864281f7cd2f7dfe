"""Pure parts of the direct TCP path: one-time tokens and the addresses it binds and dials."""

from __future__ import annotations

from p2pserve.testing import FakeClock
from p2pserve.transport.tcp import TokenBook, maddr_hosts


def test_tokens_are_single_use_and_expire():
    clock = FakeClock()
    book = TokenBook(ttl_s=30.0, clock=clock)
    a, b = book.issue("alice"), book.issue("bob")
    assert a != b and len(a) == 32
    assert book.redeem(a) == "alice" and book.redeem(a) is None  # one use, bound to its holder
    assert book.redeem("0" * 32) is None  # never issued
    clock.advance(31)
    assert book.redeem(b) is None  # expired


def test_token_book_is_bounded():
    clock = FakeClock()
    book = TokenBook(ttl_s=30.0, clock=clock, max_outstanding=8)
    tokens = [book.issue("c") for _ in range(50)]
    assert len(book) <= 8
    assert book.redeem(tokens[-1]) == "c"  # the newest survive


def test_maddr_hosts_skips_relays_and_repeats():
    maddrs = [
        "/ip4/127.0.0.1/tcp/4001/p2p/QmA",
        "/ip4/127.0.0.1/udp/4001/quic/p2p/QmA",
        "/ip6/::1/tcp/4001/p2p/QmA",
        "/ip4/1.2.3.4/tcp/4001/p2p/QmRelay/p2p-circuit/p2p/QmA",
        "/dns4/example.org/tcp/4001",
    ]
    assert maddr_hosts(maddrs) == ["127.0.0.1", "::1"]


def test_session_streams_move_to_the_direct_path_when_offered():
    """DirectTransport over an in-memory 'libp2p': OpenDirect, attach on loopback TCP, peer id checked."""
    import asyncio

    from p2pserve.protocol import SESSION_PROTOCOL, FrameLimits, GetStats, decode_reply
    from p2pserve.testing.direct import answer_direct_session
    from p2pserve.transport.frames import read_frame, write_frame
    from p2pserve.transport.memory import MemoryNetwork
    from p2pserve.transport.tcp import DirectListener, DirectTransport

    def answer(reader, writer, listener=None, remote=""):
        """The peer's session handler: offers the direct path; answers anything else with the
        name of the writer it answers on (which stream carried the frame)."""
        return answer_direct_session(reader, writer, listener, remote, name_writer=True)

    async def carried_by(listener_peer_id, mux=True):
        net = MemoryNetwork()
        listener = None
        if listener_peer_id is not None:
            listener = DirectListener(lambda r, w, remote: answer(r, w, None, remote), listener_peer_id, ["127.0.0.1"])
            await listener.start()
        net.serve("peerX", SESSION_PROTOCOL, lambda r, w, remote: answer(r, w, listener, remote))
        transport = DirectTransport(net.transport("client"), mux=mux)
        try:
            stream = await transport.open_stream("peerX", ["/ip4/127.0.0.1/tcp/1/p2p/peerX"], SESSION_PROTOCOL, 5.0)
            await write_frame(stream.writer, GetStats())
            header, _ = await read_frame(stream.reader, FrameLimits())
            stream.close()
            return stream.kind, decode_reply(header).message
        finally:
            if listener is not None:
                await listener.stop()
            await transport.close()

    assert asyncio.run(carried_by("peerX")) == ("direct", "ChannelWriter")  # a channel of the shared connection
    assert asyncio.run(carried_by("peerX", mux=False)) == ("direct", "StreamWriter")
    assert asyncio.run(carried_by(None)) == ("memory", "PipeWriter")  # no port offered: the inner stream
    assert asyncio.run(carried_by("impostor")) == ("memory", "PipeWriter")  # the TCP side is not peerX
