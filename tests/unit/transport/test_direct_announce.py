"""A peer behind a relay or a port forward: the direct path offers the announced port, binds the
listen hosts, and a client reaches it through the relay (``p2pserve peer --direct-announce-port``)."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from p2pserve.cli.peer import add_arguments, direct_address_from
from p2pserve.config import DHTConfig
from p2pserve.errors import ConfigError
from p2pserve.protocol import SESSION_PROTOCOL, DirectOffer
from p2pserve.testing.delay_relay import LinkShape, Relay, parse_hostport
from p2pserve.testing.direct import answer_direct_session
from p2pserve.transport.memory import MemoryNetwork
from p2pserve.transport.tcp import DirectAddress, DirectListener, DirectTransport


def peer_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def dht(args: argparse.Namespace) -> DHTConfig:
    return DHTConfig(model="m", host_maddrs=tuple(args.host_maddrs or ("/ip4/0.0.0.0/tcp/0",)),
                     announce_maddrs=tuple(args.announce_maddrs or ()))


def test_behind_announced_addresses_the_direct_path_binds_the_listen_hosts():
    args = peer_args("--host-maddrs", "/ip4/127.0.0.1/tcp/4001", "--announce-maddrs", "/ip4/203.0.113.7/tcp/5001",
                     "--direct-port", "4002", "--direct-announce-port", "5002")
    assert direct_address_from(args, dht(args)) == DirectAddress(listen_hosts=("127.0.0.1",), announce_port=5002)
    plain = peer_args("--host-maddrs", "/ip4/127.0.0.1/tcp/4001")
    assert direct_address_from(plain, dht(plain)) == DirectAddress()  # the visible addresses' hosts, as before


def test_an_announced_direct_port_needs_a_fixed_one_to_forward_to():
    for argv in (("--direct-announce-port", "5002"), ("--no-direct", "--direct-port", "4002", "--direct-announce-port", "5002")):
        args = peer_args(*argv)
        with pytest.raises(ConfigError, match="fixed --direct-port"):
            direct_address_from(args, dht(args))
    with pytest.raises(ConfigError):
        DirectAddress(announce_port=70000)


def test_a_client_attaches_to_the_direct_path_through_a_relay():
    """The listener offers the relay's port; the client dials it, and the relay carries the TLS bytes."""

    async def main():
        listener = DirectListener(lambda r, w, remote: answer_direct_session(r, w, None, remote), "peerX", ["127.0.0.1"])
        await listener.start()
        relay = Relay([(("127.0.0.1", 0), ("127.0.0.1", listener.port))], LinkShape(delay_s=0.005))
        listener.announce_port = parse_hostport((await relay.start())[0])[1]
        offer = listener.offer("client")
        net = MemoryNetwork()
        net.serve("peerX", SESSION_PROTOCOL, lambda r, w, remote: answer_direct_session(r, w, listener, remote))
        transport = DirectTransport(net.transport("client"))
        try:
            stream = await transport.open_stream("peerX", ["/ip4/127.0.0.1/tcp/1/p2p/peerX"], SESSION_PROTOCOL, 5.0)
            stream.close()
            return offer, listener.port, stream.kind, relay.stats[0]
        finally:
            await transport.close()
            await listener.stop()
            await relay.close()

    offer, bound, kind, stats = asyncio.run(main())
    assert isinstance(offer, DirectOffer) and offer.port != bound
    assert kind == "direct"
    assert stats.connections == 1 and stats.bytes_to_target > 0 and stats.bytes_from_target > 0
