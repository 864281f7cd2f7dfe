"""The client's node on the network: the transport it dials peers with.

libp2p (a node of its own, or the swarm DHT's node replicated), with session streams moved to a
peer's direct TCP path when the config allows it and the peer offers one.
"""

from __future__ import annotations

from p2pserve.config import ClientConfig
from p2pserve.transport import Transport
from p2pserve.transport.libp2p import Libp2pTransport
from p2pserve.transport.tcp import DirectTransport


async def client_transport(config: ClientConfig = ClientConfig(), p2p=None) -> Transport:
    """A transport for a client; ``close()`` it when done.

    ``p2p``: a hivemind ``P2P`` node to dial through (the swarm DHT's, replicated; it stays its
    owner's); without one a standalone node is started (no DHT needed for known peers).
    """
    inner = Libp2pTransport(p2p) if p2p is not None else await Libp2pTransport.create()
    if not config.direct:
        return inner
    return DirectTransport(inner, config.frame_limits, config.direct_connect_timeout_s)
