"""The transport seam: how a role reaches a peer and serves a protocol, whatever carries the bytes.

A :class:`Transport` dials a peer by id (and the addresses we know for it) and opens a
bidirectional byte :class:`Stream` for one protocol, or serves a protocol to whoever dials us.
What flows on the stream is the frame codec's business (:mod:`p2pserve.transport.frames`).

Implementations:

* :mod:`~p2pserve.transport.libp2p` — hivemind's ``P2P`` (the go-libp2p daemon). With ``dht/``,
  the only code that imports hivemind.
* :mod:`~p2pserve.transport.tcp` — the direct path: a libp2p stream upgraded to a TLS connection
  to the same peer, pinned by a fingerprint sent over that stream (client side), and the listener
  that accepts those (peer side); :mod:`~p2pserve.transport.tls` holds the TLS parts.
* :mod:`~p2pserve.transport.memory` — in-process pipes, for unit tests (no daemon, no sockets).

This module holds only the protocol and the stream struct, so importing it costs nothing.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable, Coroutine, Protocol, Sequence, runtime_checkable

from p2pserve.types import PeerId

#: Serves one inbound stream until the other side hangs up: ``handler(reader, writer, remote)``.
#: ``remote`` is the authenticated peer id of whoever opened the stream (libp2p authenticates it;
#: the direct path inherits it from the libp2p stream that issued its token). Peers key per-owner
#: quotas by it.
StreamHandler = Callable[[asyncio.StreamReader, Any, str], Coroutine[Any, Any, None]]


@dataclass(eq=False)  # one stream is one connection: identity, hashable (weak sets of streams)
class Stream:
    """One open bidirectional byte stream to a peer.

    ``writer`` has the ``asyncio.StreamWriter`` methods the frame codec uses (``write``, ``drain``,
    ``close``). ``kind`` names what carries it ("libp2p", "direct", "memory"), for logs and tests.
    """

    reader: asyncio.StreamReader
    writer: Any
    kind: str

    def close(self) -> None:
        """Close our end (best effort: the other side may be gone already)."""
        try:
            self.writer.close()
        except Exception:  # a transport torn down under us; closing is best effort
            pass


@runtime_checkable
class Transport(Protocol):
    """Opens streams to peers and serves protocols to them."""

    @property
    def peer_id(self) -> str:
        """This node's own peer id."""
        ...

    async def open_stream(self, peer_id: PeerId, maddrs: Sequence[str], protocol: str, timeout_s: float) -> Stream:
        """Dial ``peer_id`` (at ``maddrs`` when given) and open a stream for ``protocol``.

        Raises ``ConnectionError`` (or ``TimeoutError`` after ``timeout_s``) when the peer cannot
        be reached or does not serve the protocol.
        """
        ...

    async def serve(self, protocol: str, handler: StreamHandler) -> None:
        """Answer every inbound stream of ``protocol`` with ``handler``."""

    async def stop_serving(self, protocol: str) -> None:
        """Stop answering ``protocol`` (streams already open go on)."""

    async def close(self) -> None:
        """Release what this transport owns (a daemon it started, open streams)."""
