"""The direct path: the session protocol on a TLS connection, next to the libp2p stream.

Why: on loopback a frame round trip through libp2p costs ~0.29 ms (client -> its go-libp2p
daemon -> the peer's daemon -> the peer, and back: six process wake-ups), against ~0.11 ms on a
TCP socket between the two Python processes. A hop pays that on every token, so a client that
can reach a peer's address talks to it directly (ARCHITECTURE.md, "Hop topology").

How a connection is bound to the peer: the client first opens the libp2p stream, which
authenticates the peer's id, and sends ``OpenDirect``; the peer answers with its direct port, a
random one-time token and the SHA-256 of its TLS certificate (``transport/tls.py``: a key pair
made fresh when the listener starts, served with TLS 1.3 only). The client connects with TLS to
that port on each address the peer announced, in order, and after the handshake, before writing
a byte, checks that the certificate is the one pinned by the offer; at an address where it is
not (an impostor, a stale address now used by someone else) it closes and tries the next. On
the pinned connection it sends ``AttachDirect(token)``; the peer redeems the token (which it
issued to the client's authenticated peer id, so it serves the connection as that client's) and
answers ``DirectAttached``. Only then do session frames flow, served by the same handler as
libp2p streams. A connection that sends anything else first, or a wrong or expired token, is
closed.

What it gives: the same guarantees as the libp2p stream. The client knows it talks to the peer
id it dialled (the pin came over the authenticated stream), the peer knows which client it
serves (the token came over it too), and the token and activations are encrypted. There is no
plaintext mode: an offer without a fingerprint is not taken, and the stream stays on libp2p.

Behind a relay or a port forward (``p2pserve peer --announce-maddrs ... --direct-announce-port``,
:class:`DirectAddress`), the listener binds the libp2p listen hosts and offers the port that
clients must dial, while the hosts clients try stay those of the announced libp2p addresses.

Client side: :class:`DirectTransport` wraps the libp2p transport and performs that upgrade on
every session stream it opens (falling back to the libp2p stream when the peer offers no port or
none of its addresses answers with the pinned certificate). Peer side: :class:`DirectListener`
accepts the connections.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

from p2pserve.errors import WIRE_ERRORS, ConfigError, ErrorCode, P2PServeError, error_from_reply
from p2pserve.protocol import (
    SESSION_PROTOCOL,
    AttachDirect,
    DirectAttached,
    DirectOffer,
    ErrorReply,
    FrameLimits,
    OpenDirect,
    decode_reply,
    decode_request,
)
from p2pserve.transport import Stream, StreamHandler, Transport
from p2pserve.transport.frames import read_frame, write_frame
from p2pserve.transport.mux import MuxConnection
from p2pserve.transport.tls import DirectTLS, check_pin, client_context, is_fingerprint
from p2pserve.types import PeerId

log = logging.getLogger(__name__)

_ATTACH_LIMITS = FrameLimits(max_header_bytes=1024, max_payload_bytes=0)


def maddr_hosts(maddrs) -> list[str]:
    """The IP addresses in libp2p multiaddrs, in order, without repeats (for the direct path).

    Relayed addresses are skipped: a peer reachable only through a relay has no direct path.
    """
    hosts: list[str] = []
    for m in maddrs:
        parts = str(m).split("/")
        if "p2p-circuit" in parts or len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
            continue
        if parts[2] not in hosts:
            hosts.append(parts[2])
    return hosts


@dataclass(frozen=True)
class DirectAddress:
    """Where a peer's direct listener binds and which port its offers name, when a relay or a
    port forward stands in front of it (the defaults: bind the hosts of the node's visible
    libp2p addresses, offer the bound port)."""

    listen_hosts: tuple[str, ...] = ()  # hosts to bind; empty: the hosts of the visible addresses
    # The port offered to clients instead of the bound one. They dial it on the hosts of the
    # peer's announced libp2p addresses, so whatever listens there must lead to the bound port.
    announce_port: Optional[int] = None

    def __post_init__(self) -> None:
        if self.announce_port is not None and not 0 < self.announce_port < 65536:
            raise ConfigError(f"the direct path's announced port must be in [1, 65535], got {self.announce_port}")


def set_nodelay(writer: asyncio.StreamWriter) -> None:
    """Disable Nagle on a TCP stream: frames are latency-bound and already written whole."""
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# ----------------------------------------------------------------------------- client side


class DirectTransport:
    """A transport whose session streams move to the peer's direct TCP path when it offers one.

    Dials and serves through ``inner`` (libp2p); only streams of the session protocol are
    upgraded, since that is the one protocol a peer's direct port answers. With ``mux`` (the
    default), the session streams to one peer share one direct connection as channels
    (``transport/mux.py``): the first stream attaches it, every later one opens a channel on it
    (no libp2p stream, no handshake), until it ends; a peer that does not multiplex keeps a
    connection per stream.
    """

    def __init__(self, inner: Transport, limits: FrameLimits = FrameLimits(), attach_timeout_s: float = 2.0,
                 mux: bool = True):
        self.inner = inner
        self.limits = limits
        self.attach_timeout_s = attach_timeout_s
        self.mux = mux
        self._tls = client_context()
        # Direct streams still open: ``close`` ends them too (the inner transport knows nothing
        # of them, and a peer would otherwise keep serving a client that said goodbye).
        self._direct: weakref.WeakSet = weakref.WeakSet()
        self._muxed: dict[PeerId, MuxConnection] = {}  # peer id -> its shared connection
        self._attaching: dict[PeerId, asyncio.Lock] = {}  # one attach at a time per peer
        # peers whose last stream got no shared connection: their opens go on at once, each trying
        # the direct path again (a later shared connection takes them out)
        self._single: set[PeerId] = set()

    @property
    def peer_id(self) -> str:
        """The inner transport's peer id."""
        return self.inner.peer_id

    async def open_stream(self, peer_id: PeerId, maddrs: Sequence[str], protocol: str, timeout_s: float) -> Stream:
        """A channel of the peer's shared connection when there is one; else open the libp2p
        stream, then try to move it to the direct path."""
        if protocol != SESSION_PROTOCOL:
            return await self.inner.open_stream(peer_id, maddrs, protocol, timeout_s)
        conn = self._muxed.get(peer_id)
        if conn is not None and not conn.closed:
            return conn.open()
        if not self.mux or peer_id in self._single:  # nothing to share: opens need not wait in line
            return await self._open_direct(peer_id, maddrs, timeout_s)
        lock = self._attaching.setdefault(peer_id, asyncio.Lock())
        async with lock:  # streams opened at once to a peer share the one connection attached first
            conn = self._muxed.get(peer_id)
            if conn is not None and not conn.closed:
                return conn.open()
            stream = await self._open_direct(peer_id, maddrs, timeout_s)
            if peer_id not in self._muxed or self._muxed[peer_id].closed:
                self._single.add(peer_id)  # libp2p only, or a peer that does not multiplex
            return stream

    async def _open_direct(self, peer_id: PeerId, maddrs: Sequence[str], timeout_s: float) -> Stream:
        """Open the libp2p stream, then try to move it to the direct path."""
        stream = await self.inner.open_stream(peer_id, maddrs, SESSION_PROTOCOL, timeout_s)
        try:
            async with asyncio.timeout(timeout_s):
                await write_frame(stream.writer, OpenDirect())
                header, _ = await read_frame(stream.reader, self.limits)
        except asyncio.IncompleteReadError:
            stream.close()
            raise ConnectionError(f"{peer_id} closed the stream") from None
        except BaseException:
            stream.close()  # a stream that failed its first exchange is of no use to the caller
            raise
        try:
            offer = decode_reply(header)
        except WIRE_ERRORS as e:  # a peer speaking something else: keep to libp2p
            log.debug("no direct path to %s: %s", peer_id, e)
            return stream
        if isinstance(offer, ErrorReply) and offer.code == ErrorCode.OVERLOADED.value:
            # the peer refused the stream itself (its stream bounds) and closes it: say so, typed,
            # rather than hand back a stream on which nothing more is answered
            stream.close()
            raise error_from_reply(offer.code, offer.message, peer_id)
        if not isinstance(offer, DirectOffer) or not offer.port:  # an error reply: a peer without the path
            return stream
        if not is_fingerprint(offer.tls_sha256):  # nothing to pin: the token must not leave libp2p
            log.debug("no direct path to %s: its offer pins no certificate", peer_id)
            return stream
        for host in maddr_hosts(maddrs):
            direct = await self._attach(host, offer, peer_id)
            if direct is not None:
                stream.close()  # the libp2p stream carried no session yet
                return direct
        return stream

    async def _attach(self, host: str, offer: DirectOffer, peer_id: PeerId) -> Optional[Stream]:
        """A TLS stream to ``host`` that presented the offer's certificate, bound to our peer id
        by the offer's token; or None (where the pin failed, only our half of the handshake was sent)."""
        writer = None
        where = f"{host}:{offer.port}"
        try:
            async with asyncio.timeout(self.attach_timeout_s):
                reader, writer = await asyncio.open_connection(
                    host, offer.port, ssl=self._tls, ssl_handshake_timeout=self.attach_timeout_s)
                # The handshake is done; nothing of ours has been written yet. Check, then write.
                check_pin(writer.get_extra_info("ssl_object"), offer.tls_sha256, where)
                set_nodelay(writer)
                await write_frame(writer, AttachDirect(token=offer.token, mux=self.mux))
                header, _ = await read_frame(reader, self.limits)
            ack = decode_reply(header)
            if not isinstance(ack, DirectAttached) or ack.peer_id != peer_id:
                raise ConnectionError(f"{where} did not attach as {peer_id}")
        except (OSError, TimeoutError, asyncio.IncompleteReadError, P2PServeError) as e:
            # ssl.SSLError is an OSError: a failed handshake is one more address that did not answer
            log.debug("direct path to %s via %s failed: %s", peer_id, host, e)
            if writer is not None:
                writer.close()
            return None
        if self.mux and ack.mux:
            conn = self._muxed[peer_id] = MuxConnection(reader, writer, client=True).start()
            self._single.discard(peer_id)
            return conn.open()
        stream = Stream(reader, writer, "direct")
        self._direct.add(stream)
        return stream

    async def serve(self, protocol: str, handler: StreamHandler) -> None:
        """Serve through the inner transport."""
        await self.inner.serve(protocol, handler)

    async def stop_serving(self, protocol: str) -> None:
        """Stop serving through the inner transport."""
        await self.inner.stop_serving(protocol)

    async def close(self) -> None:
        """Close every direct stream and connection this transport opened, then the inner transport."""
        for stream in list(self._direct):
            stream.close()
        for conn in list(self._muxed.values()):
            conn.close()
        self._muxed.clear()
        await self.inner.close()


# ----------------------------------------------------------------------------- peer side


class TokenBook:
    """One-time tokens with an expiry, each bound to the peer id it was issued to (pure logic,
    injected clock)."""

    def __init__(self, ttl_s: float, clock=time.monotonic, max_outstanding: int = 4096):
        self.ttl_s = ttl_s
        self._clock = clock
        self._max = max_outstanding
        self._expiry: dict[str, tuple[float, str]] = {}  # token -> (expiry, holder's peer id)

    def issue(self, holder: str = "") -> str:
        """A fresh random token for ``holder``, valid for ``ttl_s``."""
        now = self._clock()
        if len(self._expiry) >= self._max:  # never grow without bound, whatever clients do
            self._expiry = {t: v for t, v in self._expiry.items() if v[0] > now}
            while len(self._expiry) >= self._max:
                self._expiry.pop(next(iter(self._expiry)))
        token = secrets.token_hex(16)
        self._expiry[token] = (now + self.ttl_s, holder)
        return token

    def redeem(self, token: str) -> str | None:
        """Consume ``token``: the holder it was issued to if it was unused and unexpired, else None."""
        entry = self._expiry.pop(token, None)
        if entry is None or entry[0] <= self._clock():
            return None
        return entry[1]

    def __len__(self) -> int:
        return len(self._expiry)


class DirectListener:
    """Accepts direct TLS connections and hands attached ones to ``handler(reader, writer, remote)``.

    ``tls`` is the listener's TLS identity; by default a fresh one is made at :meth:`start`.
    ``announce_port``, if given, is the port offers name instead of the bound one (a relay or a
    port forward in front of this listener, see :class:`DirectAddress`).
    """

    def __init__(self, handler: StreamHandler | None, peer_id: PeerId, hosts: list[str], port: int = 0,
                 token_ttl_s: float = 30.0, attach_timeout_s: float = 10.0, tls: Optional[DirectTLS] = None,
                 announce_port: Optional[int] = None, mux: bool = True, mux_idle_timeout_s: float = 300.0):
        self.handler = handler
        self.mux = mux  # a client may carry many streams on one connection (transport/mux.py)
        self.mux_idle_timeout_s = mux_idle_timeout_s  # such a connection with no stream open ends
        self.tls = tls
        self.peer_id = peer_id
        self.hosts = hosts
        self.port = port
        self.announce_port = announce_port
        self.tokens = TokenBook(token_ttl_s)
        self.attach_timeout_s = attach_timeout_s
        self._servers: list[asyncio.base_events.Server] = []

    async def start(self, handler: StreamHandler | None = None) -> int:
        """Listen with TLS on every host at one port (the first bind picks it when ``port`` is 0).

        ``handler`` serves the attached connections when the listener was built without one (a
        peer's session handler offers this listener's path, so it is built after it)."""
        if handler is not None:
            self.handler = handler
        if self.handler is None:
            raise ValueError("a DirectListener needs a stream handler to start")
        if self.tls is None:
            self.tls = DirectTLS.generate()
        for host in self.hosts:
            try:
                # A connection that never completes its handshake is dropped like one that never attaches.
                server = await asyncio.start_server(self._serve, host, self.port, ssl=self.tls.context,
                                                    ssl_handshake_timeout=self.attach_timeout_s)
            except OSError as e:
                if not self._servers:
                    raise
                log.warning("direct path not available on %s:%d (%s)", host, self.port, e)
                continue
            self.port = server.sockets[0].getsockname()[1]
            self._servers.append(server)
        log.info("direct path on %s port %d", ",".join(self.hosts), self.port)
        return self.port

    def offer(self, holder: str = "") -> DirectOffer:
        """Answer to ``OpenDirect`` from ``holder`` (its peer id): the port (the announced one, if
        set), a fresh one-time token (the connection that redeems it is served as ``holder``'s)
        and the certificate's pin. Port 0 (no direct path) until the listener has started."""
        if self.tls is None or not self._servers:
            return DirectOffer(port=0)
        return DirectOffer(port=self.announce_port or self.port, token=self.tokens.issue(holder),
                           tls_sha256=self.tls.fingerprint)

    async def stop(self) -> None:
        """Stop accepting (attached connections end with their clients)."""
        for server in self._servers:
            server.close()
        self._servers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection, its TLS handshake done: redeem its first frame's token, then serve it
        (as one stream, or as the client's channels when it multiplexes)."""
        mux = False
        try:
            set_nodelay(writer)
            async with asyncio.timeout(self.attach_timeout_s):
                header, _ = await read_frame(reader, _ATTACH_LIMITS)
            msg = decode_request(header)
            holder = self.tokens.redeem(msg.token) if isinstance(msg, AttachDirect) else None
            if holder is None:
                log.info("refused a direct connection from %s: no valid token", writer.get_extra_info("peername"))
                writer.close()
                return
            mux = isinstance(msg, AttachDirect) and msg.mux and self.mux
            await write_frame(writer, DirectAttached(peer_id=self.peer_id, mux=mux))
        except (P2PServeError, asyncio.IncompleteReadError, OSError, TimeoutError) as e:
            # OSError: ConnectionError, and ssl.SSLError from a broken TLS record
            log.info("direct connection dropped before attaching: %s", e)
            writer.close()
            return
        handler = self.handler
        assert handler is not None, "start() made sure of a handler"
        if mux:  # every channel is a stream of this client's, served by the same handler
            await MuxConnection(reader, writer, client=False, accept=lambda r, w: handler(r, w, holder),
                                idle_timeout_s=self.mux_idle_timeout_s).serve()
            return
        try:
            await handler(reader, writer, holder)
        except OSError as e:  # a TLS record that fails to decrypt ends the connection, nothing more
            log.info("direct connection from %s ended: %s", holder, e)
            writer.close()
