"""What TLS on the direct path costs per hop on loopback: frame round trips, clear TCP against TLS.

A "peer" child process serves one echo handler three ways, as a real peer serves its session
handler: on a libp2p stream (hivemind's go-libp2p daemon), on the real :class:`DirectListener`
(TLS 1.3, pinned, reached through :class:`DirectTransport` after ``OpenDirect`` on that libp2p
stream), and on a clear TCP listener (the direct path as it was before TLS: the baseline). The
client sends Forward frames (a ``Forward`` header of ~100 bytes and a payload of 8 bytes, one
int64 token; 2 KiB, one fp32 hidden state of 512; and 1 MiB) and times each round trip until the
echo is read back. The three paths take turns in blocks so that load on the machine falls on all.

Figures: per frame size, the median (and p10, p90) round trip of each path in ms, TLS / clear
TCP, and the ms TLS adds per hop (median difference; a hop pays it once per token step); and the
one-off cost of a TLS connect with its pin check against a clear TCP connect.

Usage: python benchmarks/direct_tls.py [--quick] [--rounds 1000] [--big-rounds 200] [--json out.json]
Import: ``measure(quick=False) -> dict`` (the JSON's body; ``benchmarks/trust.py`` runs it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pserve.protocol import (  # noqa: E402
    FRAME_PREFIX,
    SESSION_PROTOCOL,
    Forward,
    FrameLimits,
    OpenDirect,
    TensorMeta,
    decode_request,
)
from p2pserve.transport.frames import read_frame, write_frame  # noqa: E402
from p2pserve.transport.tcp import DirectListener, DirectTransport, set_nodelay  # noqa: E402
from p2pserve.transport.tls import check_pin, client_context, fingerprint  # noqa: E402

#: Frame payloads by name: bytes after the Forward header.
SIZES = {"forward_8B": 8, "forward_2KiB": 2048, "frame_1MiB": 1 << 20}
PATHS = ("tcp", "tls", "libp2p")
LIMITS = FrameLimits()


# ----------------------------------------------------------------------------- the peer's side


async def _echo(reader, writer, remote="", listener=None) -> None:
    """Answer ``OpenDirect`` with the listener's offer and send every other frame back as it came."""
    while True:
        try:
            header, payload = await read_frame(reader, LIMITS)
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        if listener is not None and isinstance(decode_request(header), OpenDirect):
            await write_frame(writer, listener.offer(remote))
            continue
        writer.write(FRAME_PREFIX.pack(len(header), len(payload)) + header)
        if payload:
            writer.write(payload)
        await writer.drain()


async def _peer_main(conn) -> None:
    from p2pserve.transport.libp2p import Libp2pTransport

    p2p = await Libp2pTransport.create()
    listener = DirectListener(_echo, p2p.peer_id, ["127.0.0.1"])
    await listener.start()
    await p2p.serve(SESSION_PROTOCOL, lambda r, w, remote: _echo(r, w, remote, listener))

    async def clear(reader, writer):
        set_nodelay(writer)
        await _echo(reader, writer)

    tcp = await asyncio.start_server(clear, "127.0.0.1", 0)
    libp2p_port = next(str(m).split("/")[4] for m in await p2p.p2p.get_visible_maddrs() if "/tcp/" in str(m))
    conn.send((p2p.peer_id, f"/ip4/127.0.0.1/tcp/{libp2p_port}/p2p/{p2p.peer_id}", tcp.sockets[0].getsockname()[1],
               listener.port))
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
    tcp.close()
    await listener.stop()
    await p2p.close()


def _peer_process(conn) -> None:
    asyncio.run(_peer_main(conn))


# ----------------------------------------------------------------------------- the client's side


def _frame(payload_bytes: int) -> tuple[Forward, bytes]:
    meta = TensorMeta(dtype="int64" if payload_bytes == 8 else "float32",
                      shape=[1] if payload_bytes == 8 else [1, payload_bytes // 4], nbytes=payload_bytes)
    return Forward(session_id="bench-" + "0" * 26, step=1234, position=5678, tensor=meta), bytes(payload_bytes)


async def _round_trips(stream, msg, payload: bytes, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await write_frame(stream.writer, msg, payload)
        await read_frame(stream.reader, LIMITS)
        times.append((time.perf_counter() - t0) * 1000)
    return times


async def _connects(port: tuple[int, int], pin: str, n: int) -> dict:
    """Median ms of a clear TCP connect and of a TLS connect with its pin check (``n`` each)."""
    out = {"tcp": [], "tls": []}
    for _ in range(n):
        t0 = time.perf_counter()
        _, w = await asyncio.open_connection("127.0.0.1", port[0])
        out["tcp"].append((time.perf_counter() - t0) * 1000)
        w.close()
        t0 = time.perf_counter()
        _, w = await asyncio.open_connection("127.0.0.1", port[1], ssl=client_context())
        check_pin(w.get_extra_info("ssl_object"), pin, "the bench peer")
        out["tls"].append((time.perf_counter() - t0) * 1000)
        w.close()
    return {k: statistics.median(v) for k, v in out.items()}


def _summary(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=10)
    return {"median_ms": statistics.median(times), "p10_ms": q[0], "p90_ms": q[-1], "n": len(times)}


async def measure_async(rounds: int = 1000, big_rounds: int = 200, block: int = 50, connects: int = 30) -> dict:
    """The figures (see the module docstring), with the peer in a child process."""
    from p2pserve.transport import Stream
    from p2pserve.transport.libp2p import Libp2pTransport

    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_peer_process, args=(theirs,), daemon=True)
    child.start()
    inner = None
    try:
        peer_id, maddr, tcp_port, tls_port = await asyncio.get_running_loop().run_in_executor(None, ours.recv)
        inner = await Libp2pTransport.create()
        reader, writer = await asyncio.open_connection("127.0.0.1", tcp_port)
        set_nodelay(writer)
        streams = {
            "tcp": Stream(reader, writer, "tcp"),
            "tls": await DirectTransport(inner).open_stream(peer_id, [maddr], SESSION_PROTOCOL, 30.0),
            "libp2p": await inner.open_stream(peer_id, [maddr], SESSION_PROTOCOL, 30.0),
        }
        assert streams["tls"].kind == "direct", "the direct TLS path was not taken"
        pin = fingerprint(streams["tls"].writer.get_extra_info("ssl_object").getpeercert(binary_form=True))
        result = {"sizes": {}, "connect_ms": await _connects((tcp_port, tls_port), pin, connects)}
        for name, payload_bytes in SIZES.items():
            msg, payload = _frame(payload_bytes)
            big = payload_bytes > 64 * 1024
            n, turn = (big_rounds, max(1, block // 10)) if big else (rounds, block)  # finer turns for slow frames
            times = {p: [] for p in PATHS}
            for p in PATHS:  # warm up each path (and its buffers) for this size
                await _round_trips(streams[p], msg, payload, min(20, n))
            while len(times["tcp"]) < n:
                for p in PATHS:
                    times[p] += await _round_trips(streams[p], msg, payload, min(turn, n - len(times[p])))
            row = {p: _summary(t) for p, t in times.items()}
            tcp_ms, tls_ms = row["tcp"]["median_ms"], row["tls"]["median_ms"]
            row.update(frame_bytes=payload_bytes, tls_over_tcp=tls_ms / tcp_ms, tls_added_ms=tls_ms - tcp_ms,
                       libp2p_over_tls=row["libp2p"]["median_ms"] / tls_ms)
            result["sizes"][name] = row
        for s in streams.values():
            s.close()
        # The figure trust.py lifts: what TLS adds to one hop's round trip, per frame size.
        result["encryption_cost_per_hop"] = {
            k: {"tls_added_ms": row["tls_added_ms"], "tls_over_tcp": row["tls_over_tcp"]}
            for k, row in result["sizes"].items()
        }
        return result
    finally:
        if inner is not None:
            await inner.close()
        ours.send("stop")
        child.join(30)
        if child.is_alive():
            child.kill()


def measure(quick: bool = False, rounds: int | None = None, big_rounds: int | None = None) -> dict:
    """Run :func:`measure_async` in a fresh event loop (``benchmarks/trust.py`` calls this);
    ``quick``: fewer round trips, for a smoke run. The result's ``encryption_cost_per_hop`` holds,
    per frame size, the ms TLS adds to a round trip and TLS / clear TCP."""
    rounds = rounds or (100 if quick else 1000)
    big_rounds = big_rounds or (20 if quick else 200)
    return asyncio.run(measure_async(rounds, big_rounds, connects=5 if quick else 30))


def headline(result: dict) -> str:
    """The lines a person reads first."""
    lines = [f"{'frame':<14}{'tcp ms':>9}{'tls ms':>9}{'libp2p ms':>11}{'tls/tcp':>9}{'+ms/hop':>9}"]
    for name, row in result["sizes"].items():
        lines.append(f"{name:<14}{row['tcp']['median_ms']:>9.3f}{row['tls']['median_ms']:>9.3f}"
                     f"{row['libp2p']['median_ms']:>11.3f}{row['tls_over_tcp']:>9.2f}{row['tls_added_ms']:>9.3f}")
    c = result["connect_ms"]
    lines.append(f"connect: tcp {c['tcp']:.3f} ms, tls + pin check {c['tls']:.3f} ms "
                 f"(x{c['tls'] / c['tcp']:.1f}, once per session stream)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="round trips per path for the small frames (1000)")
    parser.add_argument("--big-rounds", type=int, default=None, help="round trips per path for the 1 MiB frame (200)")
    parser.add_argument("--quick", action="store_true", help="fewer round trips: a smoke run")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the figures here")
    args = parser.parse_args()
    result = measure(args.quick, args.rounds, args.big_rounds)
    print(headline(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
