"""An impostor at a peer's direct port: it listens at an address a client may dial before the
genuine one, and records everything clients send it.

Two kinds, as an attacker would run them:

* ``tls=True``: it completes a TLS 1.3 handshake with a certificate of its own and records both
  the raw bytes on the wire and every byte of application data that TLS decrypts for it;
* ``tls=False``: it speaks the old clear-text protocol, answering at once with a
  ``DirectAttached`` frame in the victim's name, and records the raw bytes.

A TLS impostor is a relay (``upstream`` makes it a passive tap in front of a genuine listener): the raw bytes pass through a recording TCP listener on its way to a
TLS listener on another port (same process), so both views are kept per connection.
"""

from __future__ import annotations

import asyncio

from p2pserve.protocol import DirectAttached, encode_frame
from p2pserve.transport.tls import DirectTLS

#: TLS record content types (RFC 8446, section 5.1).
HANDSHAKE, CHANGE_CIPHER_SPEC, APPLICATION_DATA = 0x16, 0x14, 0x17
CLIENT_HELLO = 0x01


def tls_records(raw: bytes) -> list[tuple[int, bytes]]:
    """Split raw bytes into TLS records ``(content type, body)``; raise ValueError when they are not
    whole TLS records."""
    records, i = [], 0
    while i < len(raw):
        if len(raw) - i < 5 or raw[i + 1] != 0x03:
            raise ValueError(f"not a TLS record at byte {i}: {raw[i:i + 5]!r}")
        n = int.from_bytes(raw[i + 3:i + 5], "big")
        if len(raw) - i - 5 < n:
            raise ValueError(f"truncated TLS record at byte {i}")
        records.append((raw[i], raw[i + 5:i + 5 + n]))
        i += 5 + n
    return records


class Impostor:
    """Listens at ``host:port`` pretending to be ``victim``'s direct port (``start`` it, then
    ``stop``). ``raw``: per connection, the bytes received; ``plain``: per connection, the
    application data TLS decrypted (TLS impostor only)."""

    def __init__(self, host: str, port: int, victim: str, tls: bool = True, upstream: int = 0):
        self.host, self.port, self.victim, self.speaks_tls = host, port, victim, tls
        self._upstream = upstream  # relay to this loopback port instead: a passive tap, not an impostor
        self.raw: list[bytearray] = []
        self.plain: list[bytearray] = []
        self._servers: list[asyncio.base_events.Server] = []
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> "Impostor":
        """Listen (the TLS side on a free loopback port of its own)."""
        if self.speaks_tls and not self._upstream:
            inner = await asyncio.start_server(self._decrypt, "127.0.0.1", 0, ssl=DirectTLS.generate().context)
            self._upstream = inner.sockets[0].getsockname()[1]
            self._servers.append(inner)
        self._servers.append(await asyncio.start_server(self._accept, self.host, self.port))
        return self

    async def stop(self) -> None:
        """Stop listening, end the connections still open, and wait for their handlers."""
        for server in self._servers:
            server.close()
        for writer in list(self._writers):
            writer.close()  # the handler reads EOF and returns
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        self._writers.add(writer)
        raw = bytearray()
        self.raw.append(raw)
        try:
            if self.speaks_tls:
                await self._relay(reader, writer, raw)
            else:  # the old protocol's answer, sent before reading anything
                writer.write(b"".join(bytes(part) for part in encode_frame(DirectAttached(peer_id=self.victim))))
                await _record(reader, raw)
        finally:
            writer.close()
            self._writers.discard(writer)
            self._tasks.discard(task)

    async def _relay(self, reader, writer, raw: bytearray) -> None:
        inner_reader, inner_writer = await asyncio.open_connection("127.0.0.1", self._upstream)

        async def down():
            while data := await inner_reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.close()

        back = asyncio.create_task(down())
        try:
            await _record(reader, raw, inner_writer)
        finally:
            inner_writer.close()
            back.cancel()
            await asyncio.gather(back, return_exceptions=True)

    async def _decrypt(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        plain = bytearray()
        self.plain.append(plain)
        await _record(reader, plain)
        writer.close()


async def _record(reader: asyncio.StreamReader, into: bytearray, forward=None) -> None:
    """Append everything ``reader`` yields to ``into`` (and write it to ``forward``) until EOF."""
    try:
        while data := await reader.read(65536):
            into += data
            if forward is not None:
                forward.write(data)
                await forward.drain()
    except OSError:  # reset, or a TLS error: the client gave up on us
        pass
