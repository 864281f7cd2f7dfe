"""A delaying, rate-limiting TCP relay: a wide-area link in front of a peer's ports.

Why: the kernel of the test machines has no ``netem`` (``tc tbf`` shapes rate, nothing adds
delay), and what a swarm across the internet costs is mostly delay. Peers started behind a
relay announce the relay's addresses (``p2pserve peer --announce-maddrs`` and
``--direct-announce-port``), so every byte that clients and other peers send them, and every
byte of the replies, crosses it: libp2p streams, link probes and the direct TLS path alike.
No library from the package registries does this (Toxiproxy, the usual tool, is a Go server
that no registry we can reach ships), so it is written here, on asyncio.

The link model, in each direction of each connection (``Schedule``): bytes read at ``t`` are
serialised at ``rate`` behind the bytes before them, then propagate for ``delay``; they are
written out no earlier than ``max(t, previous piece done) + n / rate + delay``. So a round
trip costs at least two delays, and a bulk transfer runs at most at ``rate``. Bytes held
in flight are bounded per direction (``LinkShape.max_held_bytes``): when that many are held,
the relay stops reading, and TCP's own flow control pushes back on the sender. Make it at least
``rate x delay`` (the bandwidth-delay product) or it caps the throughput below ``rate``.

What it does not model: loss, jitter, reordering; the TCP handshake with the relay itself is
not delayed (the first bytes are, so every protocol's own handshake pays its round trips).

    python -m p2pserve.testing.delay_relay --listen 127.0.0.1:0 --to 127.0.0.1:4001 \\
        --listen 127.0.0.1:0 --to 127.0.0.1:4002 --delay-ms 25 --rate-mbps 100 --stats stats.json

prints ``P2PSERVE_RELAY_READY listen=HOST:PORT,HOST:PORT`` (the pairs in order) once it listens,
and keeps per-route byte counts in ``--stats`` (JSON, rewritten twice a second and on exit).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass, field
from typing import Optional

from p2pserve.errors import ConfigError

log = logging.getLogger(__name__)

_EOF = None  # queued after a direction's last bytes: half-close the other side when it is due


@dataclass(frozen=True)
class LinkShape:
    """One direction of a link: its one-way delay and rate, and what the relay may hold."""

    delay_s: float = 0.0  # one-way propagation delay
    rate_bytes_per_s: float = 0.0  # serialisation rate; 0 = unlimited
    max_held_bytes: int = 4 << 20  # read no more while this much waits (>= rate x delay to keep the rate)
    piece_bytes: int = 16 << 10  # pacing granularity: a read is released in pieces of at most this

    def __post_init__(self) -> None:
        if self.delay_s < 0 or self.rate_bytes_per_s < 0:
            raise ConfigError("a link's delay and rate must be >= 0")
        if self.max_held_bytes <= 0 or self.piece_bytes <= 0:
            raise ConfigError("max_held_bytes and piece_bytes must be > 0")


class Schedule:
    """When each piece of one direction's byte stream leaves the link (pure; times in seconds)."""

    def __init__(self, shape: LinkShape):
        self.shape = shape
        self._free_at = float("-inf")  # when the serialiser finishes what it was given so far

    def release_at(self, now: float, n: int) -> float:
        """The time ``n`` bytes read at ``now`` are due out: queued behind earlier bytes,
        serialised at the rate, then delayed."""
        start = max(now, self._free_at)
        rate = self.shape.rate_bytes_per_s
        self._free_at = start + (n / rate if rate > 0 else 0.0)
        return self._free_at + self.shape.delay_s


@dataclass
class RouteStats:
    """Counts for one listening address (what the test of a relayed swarm reads)."""

    listen: str
    target: str
    connections: int = 0
    bytes_to_target: int = 0
    bytes_from_target: int = 0
    held_bytes: int = 0  # read and not yet written, over every connection and direction now
    peak_held_bytes: int = 0

    def hold(self, delta: int) -> None:
        """Bytes read (``delta`` > 0) or written out (< 0)."""
        self.held_bytes += delta
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)

    def as_dict(self) -> dict:
        """The counts as JSON-ready values."""
        return dict(listen=self.listen, target=self.target, connections=self.connections,
                    bytes_to_target=self.bytes_to_target, bytes_from_target=self.bytes_from_target,
                    held_bytes=self.held_bytes, peak_held_bytes=self.peak_held_bytes)


class Pipe:
    """One direction of one relayed connection: reads, stamps, holds, paces and writes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, shape: LinkShape,
                 stats: RouteStats, counter: str, *, read_size: int = 64 << 10):
        self.reader, self.writer, self.shape = reader, writer, shape
        self._stats, self._counter = stats, counter  # the RouteStats field counting bytes written
        self._read_size = read_size
        self._schedule = Schedule(shape)
        self._queue: collections.deque[tuple[float, Optional[bytes]]] = collections.deque()  # (due, piece)
        self._held = 0  # bytes read and not yet written out
        self._queued = asyncio.Event()  # set when a piece (or the end) was queued
        self._room = asyncio.Event()  # set when written bytes made room under max_held_bytes

    async def run(self) -> None:
        """Relay until the reading side ends and everything held is written; raises when either
        side breaks (a reset, a write to a closed socket)."""
        tasks = [asyncio.ensure_future(self._pump_in()), asyncio.ensure_future(self._pump_out())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                t.result()  # re-raise a side's failure
            await tasks[1]  # the reader is done: write out what it left
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._stats.hold(-self._held)  # what a broken connection still held is dropped
            self._held = 0

    async def _pump_in(self) -> None:
        loop = asyncio.get_running_loop()
        step = self.shape.piece_bytes
        while True:
            while self._held >= self.shape.max_held_bytes:  # backpressure: stop reading
                self._room.clear()
                await self._room.wait()
            data = await self.reader.read(self._read_size)
            now = loop.time()
            if not data:
                self._queue.append((self._schedule.release_at(now, 0), _EOF))
                self._queued.set()
                return
            for i in range(0, len(data), step):
                piece = data[i:i + step]
                self._queue.append((self._schedule.release_at(now, len(piece)), piece))
                self._held += len(piece)
            self._stats.hold(len(data))
            self._queued.set()

    async def _pump_out(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._queued.clear()
                await self._queued.wait()
                continue
            due = self._queue[0][0]
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            written = 0
            while self._queue and self._queue[0][0] <= loop.time():  # everything due, in one write
                _, piece = self._queue.popleft()
                if piece is _EOF:
                    await self._flush(written)
                    if self.writer.can_write_eof():
                        self.writer.write_eof()
                    return
                self.writer.write(piece)
                written += len(piece)
            await self._flush(written)

    async def _flush(self, written: int) -> None:
        if written:
            await self.writer.drain()
            self._held -= written
            self._stats.hold(-written)
            setattr(self._stats, self._counter, getattr(self._stats, self._counter) + written)
            self._room.set()  # room again for the reader


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def parse_hostport(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as a tuple; ConfigError otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


@dataclass
class Relay:
    """Listens on each ``listen`` address and relays every connection to the matching target
    through a link of ``shape`` in each direction. ``start`` binds (port 0 picks one);
    ``listening`` then gives the bound addresses."""

    routes: list[tuple[tuple[str, int], tuple[str, int]]]  # (listen, target) pairs
    shape: LinkShape = field(default_factory=LinkShape)
    stats: list[RouteStats] = field(default_factory=list)
    _servers: list[asyncio.base_events.Server] = field(default_factory=list)
    _tasks: set[asyncio.Task] = field(default_factory=set)

    async def start(self) -> list[str]:
        """Bind every listening address; returns them as ``HOST:PORT`` (ports resolved)."""
        for (host, port), target in self.routes:
            stats = RouteStats(listen="", target=f"{target[0]}:{target[1]}")
            server = await asyncio.start_server(
                lambda r, w, t=target, s=stats: self._spawn(self._serve(r, w, t, s)), host, port)
            stats.listen = f"{host}:{server.sockets[0].getsockname()[1]}"
            self.stats.append(stats)
            self._servers.append(server)
        return self.listening

    @property
    def listening(self) -> list[str]:
        """The bound addresses, in the order of ``routes``."""
        return [s.listen for s in self.stats]

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # held, so that a running connection is never garbage-collected
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader, writer, target: tuple[str, int], stats: RouteStats) -> None:
        """One accepted connection: connect to the target, relay both ways, close both."""
        try:
            up_reader, up_writer = await asyncio.open_connection(*target)
        except OSError as e:  # the peer behind is gone: the client sees its connection closed
            log.info("relay to %s:%d failed: %s", *target, e)
            writer.close()
            return
        stats.connections += 1
        for w in (writer, up_writer):
            _nodelay(w)
        pipes = [Pipe(reader, up_writer, self.shape, stats, "bytes_to_target"),
                 Pipe(up_reader, writer, self.shape, stats, "bytes_from_target")]
        tasks = [asyncio.ensure_future(p.run()) for p in pipes]
        try:
            # a broken side (reset, write to a closed socket) ends the whole connection at once
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    log.debug("relayed connection ended: %r", t.exception())
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for w in (writer, up_writer):
                w.close()

    async def close(self) -> None:
        """Stop listening and end every relayed connection."""
        for server in self._servers:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def stats_json(self) -> str:
        """Every route's counts, as JSON."""
        return json.dumps({"delay_ms": self.shape.delay_s * 1e3,
                           "rate_mbps": self.shape.rate_bytes_per_s * 8 / 1e6,
                           "routes": [s.as_dict() for s in self.stats]})


def write_stats(relay: Relay, path: Optional[str]) -> None:
    """Replace ``path`` with the relay's counts (atomically: readers never see half a file)."""
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(relay.stats_json())
        os.replace(tmp, path)


def build_parser() -> argparse.ArgumentParser:
    """The relay's flags."""
    p = argparse.ArgumentParser(prog="python -m p2pserve.testing.delay_relay", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", action="append", required=True, metavar="HOST:PORT",
                   help="address to listen on (port 0 picks one); repeat, one per --to")
    p.add_argument("--to", action="append", required=True, metavar="HOST:PORT",
                   help="where the matching --listen relays to")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added in each direction")
    p.add_argument("--rate-mbps", type=float, default=0.0, help="rate of each direction in Mbit/s (0: unlimited)")
    p.add_argument("--max-held-kb", type=int, default=LinkShape.max_held_bytes >> 10,
                   help="KiB held per direction of a connection before reading stops")
    p.add_argument("--stats", default=None, metavar="PATH", help="keep per-route byte counts in this JSON file")
    return p


async def _main(args: argparse.Namespace) -> None:
    if len(args.listen) != len(args.to):
        raise ConfigError("give one --to for each --listen")
    shape = LinkShape(delay_s=args.delay_ms / 1e3, rate_bytes_per_s=args.rate_mbps * 1e6 / 8,
                      max_held_bytes=args.max_held_kb << 10)
    relay = Relay([(parse_hostport(a), parse_hostport(b)) for a, b in zip(args.listen, args.to)], shape)
    listening = await relay.start()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print(f"P2PSERVE_RELAY_READY listen={','.join(listening)}", flush=True)
    try:
        while not stop.is_set():
            write_stats(relay, args.stats)
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                pass
    finally:
        write_stats(relay, args.stats)
        await relay.close()


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``python -m p2pserve.testing.delay_relay``."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s relay: %(message)s")
    try:
        asyncio.run(_main(args))
    except (ConfigError, OSError) as e:  # a bad flag, an address already taken
        print(f"delay_relay: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
