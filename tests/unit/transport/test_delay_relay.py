"""The delaying relay (``p2pserve.testing.delay_relay``): its link schedule, and real sockets through it.

The socket tests assert only lower bounds that the relay enforces by construction (a byte is
never written before its due time), never that anything is fast.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from p2pserve.errors import ConfigError
from p2pserve.testing.delay_relay import LinkShape, Relay, Schedule, parse_hostport


def test_schedule_adds_the_delay_to_every_piece():
    s = Schedule(LinkShape(delay_s=0.025))
    assert s.release_at(10.0, 100) == pytest.approx(10.025)
    assert s.release_at(10.001, 100) == pytest.approx(10.026)


def test_schedule_serialises_at_the_rate_behind_earlier_bytes():
    s = Schedule(LinkShape(delay_s=0.010, rate_bytes_per_s=1000.0))
    assert s.release_at(0.0, 500) == pytest.approx(0.510)  # 0.5 s on the wire, then the delay
    assert s.release_at(0.1, 500) == pytest.approx(1.010)  # queued behind the first piece
    assert s.release_at(5.0, 100) == pytest.approx(5.110)  # an idle link starts at once


def test_link_shape_and_addresses_are_checked():
    with pytest.raises(ConfigError):
        LinkShape(delay_s=-1)
    with pytest.raises(ConfigError):
        LinkShape(max_held_bytes=0)
    assert parse_hostport("127.0.0.1:4001") == ("127.0.0.1", 4001)
    assert parse_hostport("[::1]:80") == ("::1", 80)
    for bad in ("127.0.0.1", ":80", "host:port", "h:70000"):
        with pytest.raises(ConfigError):
            parse_hostport(bad)


async def _echo_server():
    async def echo(reader, writer):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _relay_to(port: int, shape: LinkShape) -> tuple[Relay, int]:
    relay = Relay([(("127.0.0.1", 0), ("127.0.0.1", port))], shape)
    listening = await relay.start()
    return relay, parse_hostport(listening[0])[1]


def test_a_round_trip_through_the_relay_pays_both_delays_and_bytes_arrive_intact():
    async def main():
        server, port = await _echo_server()
        relay, rport = await _relay_to(port, LinkShape(delay_s=0.030))
        reader, writer = await asyncio.open_connection("127.0.0.1", rport)
        t0 = time.perf_counter()
        writer.write(b"ping")
        assert await reader.readexactly(4) == b"ping"
        rtt = time.perf_counter() - t0
        blob = os.urandom(300_000)  # several pieces, both directions
        writer.write(blob)
        assert await reader.readexactly(len(blob)) == blob
        writer.close()
        await relay.close()
        server.close()
        return rtt, relay.stats[0]

    rtt, stats = asyncio.run(main())
    assert rtt >= 0.060 - 0.002  # two one-way delays at least
    assert stats.connections == 1
    assert stats.bytes_to_target == stats.bytes_from_target == 300_004
    assert stats.held_bytes == 0


def test_the_rate_paces_a_bulk_transfer():
    async def main():
        server, port = await _echo_server()
        relay, rport = await _relay_to(port, LinkShape(rate_bytes_per_s=1e6))  # 8 Mbit/s each way
        reader, writer = await asyncio.open_connection("127.0.0.1", rport)
        t0 = time.perf_counter()
        writer.write(bytes(200_000))
        await reader.readexactly(200_000)
        took = time.perf_counter() - t0
        writer.close()
        await relay.close()
        server.close()
        return took

    assert asyncio.run(main()) >= 0.2 - 0.002  # 200 kB at 1 MB/s, however fast the host


def test_a_receiver_that_never_reads_holds_the_relay_to_its_bound():
    shape = LinkShape(max_held_bytes=256 << 10)

    async def main():
        stalled = asyncio.Event()

        async def never_read(reader, writer):
            await stalled.wait()
            writer.close()

        server = await asyncio.start_server(never_read, "127.0.0.1", 0)
        relay, rport = await _relay_to(server.sockets[0].getsockname()[1], shape)
        _, writer = await asyncio.open_connection("127.0.0.1", rport)
        chunk = bytes(1 << 20)
        sent = 0
        with pytest.raises(TimeoutError):  # the sender is pushed back: its writes stop draining
            async with asyncio.timeout(3.0):
                while True:
                    writer.write(chunk)
                    await writer.drain()
                    sent += len(chunk)
        stats = relay.stats[0]
        stalled.set()
        writer.transport.abort()
        await relay.close()
        server.close()
        return sent, stats

    sent, stats = asyncio.run(main())
    assert stats.peak_held_bytes <= shape.max_held_bytes + (64 << 10)  # plus at most one read
    assert sent < 512 << 20


def test_the_relay_process_prints_its_addresses_and_keeps_counts(tmp_path):
    async def echo_once(port: int) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello")
        data = await reader.readexactly(5)
        writer.close()
        return data

    async def main():
        server, port = await _echo_server()
        stats_path = tmp_path / "stats.json"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "p2pserve.testing.delay_relay", "--listen", "127.0.0.1:0", "--to",
            f"127.0.0.1:{port}", "--listen", "127.0.0.1:0", "--to", f"127.0.0.1:{port}", "--delay-ms", "5",
            "--stats", str(stats_path), stdout=subprocess.PIPE)
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
            assert line.startswith("P2PSERVE_RELAY_READY listen=")
            second = parse_hostport(line.split("=", 1)[1].strip().split(",")[1])[1]
            assert await echo_once(second) == b"hello"
        finally:
            proc.terminate()
            await proc.wait()
            server.close()
        return json.loads(stats_path.read_text())

    stats = asyncio.run(main())
    assert stats["delay_ms"] == 5
    first, second = stats["routes"]
    assert first["connections"] == 0 and second["connections"] == 1
    assert second["bytes_to_target"] == second["bytes_from_target"] == 5


def test_the_relay_process_refuses_unpaired_addresses():
    done = subprocess.run([sys.executable, "-m", "p2pserve.testing.delay_relay", "--listen", "127.0.0.1:0",
                           "--listen", "127.0.0.1:0", "--to", "127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "one --to for each --listen" in done.stderr
