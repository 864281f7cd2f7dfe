"""The libp2p transport: hivemind's ``P2P`` node (a go-libp2p daemon driven over a socket).

With ``dht/``, this is the only code that imports hivemind. Streams are the daemon's binary
stream handlers: relays and hole punching come with it, and the peer is authenticated by id.
"""

from __future__ import annotations

import asyncio
from typing import Sequence

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from p2pserve.parent_watch import children_die_with_us
from p2pserve.transport import Stream, StreamHandler
from p2pserve.types import PeerId

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


class Libp2pTransport:
    """A :class:`~p2pserve.transport.Transport` over one hivemind ``P2P`` node.

    ``owned`` says whether :meth:`close` shuts the node down: a node this transport started
    (:meth:`create`) is; one replicated from a DHT node belongs to the DHT's owner.
    """

    def __init__(self, p2p: P2P, owned: bool = False):
        self.p2p = p2p
        self.owned = owned

    @classmethod
    async def create(cls, initial_peers: Sequence[str] = (), host_maddrs: Sequence[str] = (LOOPBACK,)) -> "Libp2pTransport":
        """Start a standalone libp2p node (a client on an explicit chain needs no DHT)."""
        with children_die_with_us():  # its p2pd ends with this process (parent_watch.py)
            p2p = await P2P.create(initial_peers=list(initial_peers), host_maddrs=list(host_maddrs))
        return cls(p2p, owned=True)

    @property
    def peer_id(self) -> str:
        """This node's peer id (base58)."""
        return str(self.p2p.peer_id)

    async def dial(self, peer_id: PeerId, maddrs: Sequence[str]) -> None:
        """Make the daemon connect to ``peer_id`` at ``maddrs`` (no-op without addresses).

        hivemind's ``P2P`` has no public call for this (checked against hivemind 1.1.12: only
        ``list_peers``, ``wait_for_at_least_n_peers`` and the handler calls, which need the daemon
        to know an address already), so we use the daemon client it wraps. A peer we only know by
        address from a plan or a ``--peers`` flag is unreachable otherwise.
        """
        if not maddrs:
            return
        # The daemon wants transport addresses; the /p2p/<id> suffix goes in peer_id.
        addrs = [Multiaddr(m.split("/p2p/")[0]) for m in maddrs]
        # hivemind annotates _client as None (it is set when the daemon starts)
        await self.p2p._client.connect(PeerID.from_base58(peer_id), addrs)  # pyright: ignore[reportAttributeAccessIssue]

    async def open_stream(self, peer_id: PeerId, maddrs: Sequence[str], protocol: str, timeout_s: float) -> Stream:
        """Dial and open a binary stream, both within ``timeout_s``."""
        async with asyncio.timeout(timeout_s):
            await self.dial(peer_id, maddrs)
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), protocol)
        return Stream(reader, writer, "libp2p")

    async def serve(self, protocol: str, handler: StreamHandler) -> None:
        """Register ``handler`` for inbound streams of ``protocol``."""

        async def on_stream(info, reader, writer) -> None:  # hivemind passes the stream info first
            await handler(reader, writer, str(info.peer_id))

        await self.p2p.add_binary_stream_handler(protocol, on_stream)

    async def stop_serving(self, protocol: str) -> None:
        """Unregister ``protocol``'s handler."""
        await self.p2p.remove_binary_stream_handler(protocol)

    async def close(self) -> None:
        """Shut the node down if this transport started it."""
        if self.owned:
            await self.p2p.shutdown()
