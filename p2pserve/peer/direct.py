"""The direct path: the session protocol on a plain TCP socket, next to the libp2p stream.

Why: on loopback a frame round trip through libp2p costs ~0.29 ms (client -> its go-libp2p
daemon -> the peer's daemon -> the peer, and back: six process wake-ups), against ~0.11 ms on a
TCP socket between the two Python processes. A hop pays that on every token, so a client that
can reach a peer's address talks to it directly (ARCHITECTURE.md, "Hop topology").

How a connection is bound to the peer: the client first opens the libp2p stream, which
authenticates the peer's id, and sends ``OpenDirect``; the peer answers with its TCP port and a
random one-time token. The client connects to that port on the address it dialled, sends
``AttachDirect(token)`` as the first frame, and the peer answers ``DirectAttached`` with its peer
id. Only then do session frames flow, served by the same ``SessionHandler`` as libp2p streams.
A connection that sends anything else first, or a wrong or expired token, is closed.

What it does not give: encryption. Activations cross the direct path in the clear, as they do
inside any datacentre; peers started with ``--no-direct`` and clients with ``direct=False`` keep
everything on libp2p's encrypted streams.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from p2pserve.errors import P2PServeError
from p2pserve.protocol import AttachDirect, DirectAttached, DirectOffer, FrameLimits, decode_request
from p2pserve.transport import read_frame, set_nodelay, write_frame

log = logging.getLogger(__name__)

_ATTACH_LIMITS = FrameLimits(max_header_bytes=1024, max_payload_bytes=0)


class TokenBook:
    """One-time tokens with an expiry (pure logic, injected clock)."""

    def __init__(self, ttl_s: float, clock=time.monotonic, max_outstanding: int = 4096):
        self.ttl_s = ttl_s
        self._clock = clock
        self._max = max_outstanding
        self._expiry: dict[str, float] = {}

    def issue(self) -> str:
        """A fresh random token, valid for ``ttl_s``."""
        now = self._clock()
        if len(self._expiry) >= self._max:  # never grow without bound, whatever clients do
            self._expiry = {t: e for t, e in self._expiry.items() if e > now}
            while len(self._expiry) >= self._max:
                self._expiry.pop(next(iter(self._expiry)))
        token = secrets.token_hex(16)
        self._expiry[token] = now + self.ttl_s
        return token

    def redeem(self, token: str) -> bool:
        """Consume ``token``; True if it was issued, unused and unexpired."""
        expiry = self._expiry.pop(token, None)
        return expiry is not None and expiry > self._clock()


class DirectListener:
    """Accepts direct TCP connections and hands attached ones to the session handler."""

    def __init__(self, handler, peer_id: str, hosts: list[str], port: int = 0, token_ttl_s: float = 30.0,
                 attach_timeout_s: float = 10.0):
        self.handler = handler
        self.peer_id = peer_id
        self.hosts = hosts
        self.port = port
        self.tokens = TokenBook(token_ttl_s)
        self.attach_timeout_s = attach_timeout_s
        self._servers: list[asyncio.base_events.Server] = []

    async def start(self) -> int:
        """Listen on every host at one port (the first bind picks it when ``port`` is 0)."""
        for host in self.hosts:
            try:
                server = await asyncio.start_server(self._serve, host, self.port)
            except OSError as e:
                if not self._servers:
                    raise
                log.warning("direct path not available on %s:%d (%s)", host, self.port, e)
                continue
            self.port = server.sockets[0].getsockname()[1]
            self._servers.append(server)
        log.info("direct path on %s port %d", ",".join(self.hosts), self.port)
        return self.port

    def offer(self) -> DirectOffer:
        """Answer to ``OpenDirect``: the port and a fresh one-time token."""
        return DirectOffer(port=self.port, token=self.tokens.issue())

    async def stop(self) -> None:
        """Stop accepting (attached connections end with their clients)."""
        for server in self._servers:
            server.close()
        self._servers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            set_nodelay(writer)
            async with asyncio.timeout(self.attach_timeout_s):
                header, _ = await read_frame(reader, _ATTACH_LIMITS)
            msg = decode_request(header)
            if not isinstance(msg, AttachDirect) or not self.tokens.redeem(msg.token):
                log.info("refused a direct connection from %s: no valid token", writer.get_extra_info("peername"))
                writer.close()
                return
            await write_frame(writer, DirectAttached(peer_id=self.peer_id))
        except (P2PServeError, asyncio.IncompleteReadError, ConnectionError, TimeoutError) as e:
            log.info("direct connection dropped before attaching: %s", e)
            writer.close()
            return
        await self.handler.handle_stream(None, reader, writer)
