"""Measurements of the control plane on this machine (figures quoted in docs/control-plane.md).

    python -m tools.measure dht [--nodes 4] [--rounds 20]
    python -m tools.measure probe --target /ip4/.../p2p/12D3... [--rounds 3]
    python -m tools.measure serve-probe            # a probe target: prints its multiaddr

``dht`` starts N loopback DHT nodes and reports node start time, signed store / validated read
latency of PeerInfo, record sizes and RSA sign/verify cost. ``probe`` measures one link with
the real prober (the target runs ``serve-probe``, e.g. in another network namespace).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time


def _pct(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_ms": round(statistics.median(xs) * 1e3, 3), "p90_ms": round(xs[int(0.9 * (len(xs) - 1))] * 1e3, 3), "n": len(xs)}


def measure_dht(nodes: int, rounds: int) -> dict:
    """Start ``nodes`` loopback DHT nodes and time the record operations."""
    out = _swarm_timings(nodes, rounds)
    out.update(_signature_timings())
    out.update(_record_costs())
    return out


def _swarm_timings(nodes: int, rounds: int) -> dict:
    """Node start, signed announce and validated read times on ``nodes`` loopback DHT nodes."""
    from p2pserve.dht.config import DHTConfig
    from p2pserve.dht.records import PeerInfo, encode_record
    from p2pserve.dht.swarm import Swarm

    out: dict = {}
    starts, swarms = [], []
    for i in range(nodes):
        cfg = DHTConfig(model="bench", host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                        initial_peers=tuple(swarms[0].visible_maddrs()) if swarms else ())
        t = time.perf_counter()
        swarms.append(Swarm.create(cfg))
        starts.append(time.perf_counter() - t)
    out["dht_node_start"] = _pct(starts)

    def info(sw, j):
        return PeerInfo(model="bench", peer_id=sw.peer_id, max_layers=32, throughput_decode=[1000.0 / k for k in range(1, 33)],
                        throughput_prefill=[8000.0 / k for k in range(1, 33)], serving=(0, 16), state="serving",
                        addrs=sw.visible_maddrs(), device="NVIDIA H100", timestamp=time.time() + j * 1e-3)

    async def go():
        stores, reads = [], []
        for j in range(rounds):
            for sw in swarms[1:]:
                t = time.perf_counter()
                await sw.announce_peer(info(sw, j))
                stores.append(time.perf_counter() - t)
            t = time.perf_counter()
            got = await swarms[0].get_peers()
            reads.append(time.perf_counter() - t)
            assert len(got) == nodes - 1, got.keys()
        return stores, reads

    try:
        stores, reads = asyncio.run(go())
        out["announce_peer_signed_store"] = _pct(stores)
        out[f"get_peers_{nodes - 1}_records_validated"] = _pct(reads)
        out["peerinfo_bytes_32_layers"] = len(encode_record(info(swarms[0], 0)))
    finally:
        for sw in swarms:
            sw.shutdown()
    return out


def _signature_timings() -> dict:
    """RSA-2048 sign and verify times of a 1 kB record."""
    from hivemind.utils.crypto import RSAPrivateKey

    key = RSAPrivateKey()
    pub = key.get_public_key()
    data = b"x" * 1000
    t = time.perf_counter()
    sigs = [key.sign(data) for _ in range(50)]
    out = {"rsa2048_sign_ms": round((time.perf_counter() - t) / 50 * 1e3, 3)}
    t = time.perf_counter()
    for s in sigs:
        pub.verify(data, s)
    out["rsa2048_verify_ms"] = round((time.perf_counter() - t) / 50 * 1e3, 3)
    return out


def _record_costs() -> dict:
    """Decode + validate cost of a peer record, and plan time and size for a 64-peer swarm."""
    from p2pserve.coordinator.service import CoordinatorConfig, Snapshot, make_plan
    from p2pserve.dht.records import PeerInfo, decode_record, encode_record

    out: dict = {}
    peers = {f"peer{i:02d}": PeerInfo(model="bench", peer_id=f"peer{i:02d}", max_layers=16,
                                      throughput_decode=[1000.0 / k for k in range(1, 17)],
                                      serving=((i % 4) * 8, (i % 4) * 8 + 8), state="serving") for i in range(64)}
    blob = encode_record(next(iter(peers.values())))
    t = time.perf_counter()
    for _ in range(1000):
        decode_record(blob, PeerInfo)
    out["peerinfo_decode_validate_us"] = round((time.perf_counter() - t) / 1000 * 1e6, 2)
    t = time.perf_counter()
    plan = make_plan(Snapshot(peers, {}), {}, epoch=1, leader_id="c", model="bench",
                     cfg=CoordinatorConfig(num_layers=32), reason="bench", now=time.time())
    out["plan_64_peers_make_ms"] = round((time.perf_counter() - t) * 1e3, 2)
    out["plan_64_peers_bytes"] = len(encode_record(plan))
    return out


def measure_probe(target: str, rounds: int, max_bytes: int) -> dict:
    """Probe the peer at multiaddr ``target`` ``rounds`` times."""
    import hivemind

    from p2pserve.dht.prober import LinkProber, ProberConfig

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/0.0.0.0/tcp/0"], initial_peers=[target])
    pid = target.rsplit("/p2p/", 1)[1]

    async def go():
        p2p = await dht.replicate_p2p()
        prober = LinkProber(p2p, ProberConfig(max_probe_bytes=max_bytes, timeout_s=60.0))
        res = []
        for _ in range(rounds):
            t = time.perf_counter()
            s = await prober.probe(pid, [target])
            res.append({"bandwidth_MBps": round(s.bandwidth / 1e6, 3), "mbit_s": round(s.bandwidth * 8 / 1e6, 2),
                        "rtt_ms": round(s.rtt * 1e3, 3), "probe_wall_s": round(time.perf_counter() - t, 3)})
        return res

    try:
        return {"target": target, "rounds": asyncio.run(go())}
    finally:
        dht.shutdown()


def serve_probe(host: str) -> int:
    """Run a DHT node with the probe handler until killed; prints its multiaddrs."""
    import hivemind

    from p2pserve.dht.prober import LinkProber

    dht = hivemind.DHT(start=True, host_maddrs=[host])

    async def go():
        prober = LinkProber(await dht.replicate_p2p())
        await prober.start()
        for m in dht.get_visible_maddrs():
            print(f"maddr {m}", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(go())
    finally:
        dht.shutdown()
    return 0


def main(argv=None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(prog="python -m tools.measure")
    sub = ap.add_subparsers(dest="what", required=True)
    d = sub.add_parser("dht")
    d.add_argument("--nodes", type=int, default=4)
    d.add_argument("--rounds", type=int, default=20)
    p = sub.add_parser("probe")
    p.add_argument("--target", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    s = sub.add_parser("serve-probe")
    s.add_argument("--host", default="/ip4/0.0.0.0/tcp/0")
    a = ap.parse_args(argv)
    if a.what == "dht":
        print(json.dumps(measure_dht(a.nodes, a.rounds), indent=2))
    elif a.what == "probe":
        print(json.dumps(measure_probe(a.target, a.rounds, a.max_bytes), indent=2))
    else:
        return serve_probe(a.host)
    return 0


if __name__ == "__main__":
    sys.exit(main())
