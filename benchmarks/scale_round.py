"""Where a coordinator's round goes on a synthetic swarm of announced peers, phase by phase.

The swarm of ``scale_swarm`` (N signed identities on one DHT node, a coordinator node joined to
it); the coordinator's round (read every PeerInfo and LinkInfo, plan, publish the chunked plan) is
repeated ``--rounds`` times, each phase timed on its own:

* read: ``get_peers``, ``get_links`` (each one DHT get of a key with N subkeys, decoded and
  validated), the snapshot;
* solve: the topology from the snapshot, the targets (``plan_at_scale`` for a fresh plan), the
  flows over the served ranges -- ``make_plan`` as a whole, and its parts measured apart;
* publish: ``Swarm.publish_plan`` (the index and the chunks that changed).

Each round is a fresh plan (no current targets) at a new epoch, so every round publishes. The
round's target is 10 s; printed: each phase's median and worst over the rounds, and the round's
total against the target. Timings are wall clock, noisy on a shared machine.
``--busy N`` spins N processes on the CPUs during the rounds (a loaded machine); ``--half-serving``
first has every other peer serve its target of an untimed plan, so each round re-solves with
newcomers (a fresh plan relabelled onto the current placement, flows over the served ranges).
``python benchmarks/scale_round.py --peers 300 --rounds 5 --json benchmarks/results/scale_round.json``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import replace
from dataclasses import replace as dc_replace
from pathlib import Path
from typing import Any

from planner_repro import loaded_machine  # benchmarks/ is on sys.path as a script

from p2pserve.clock import wall
from p2pserve.config import CoordinatorConfig, DHTConfig
from p2pserve.coordinator.plan_record import compute_flows, make_plan
from p2pserve.coordinator.snapshot import Snapshot
from p2pserve.coordinator.targets import build_topology, plan_targets
from p2pserve.coordinator.trigger import Reason, Trigger
from p2pserve.dht.multi_identity import identity_swarms
from p2pserve.dht.records import CoordinatorCandidate
from p2pserve.dht.signing import load_or_create_key
from p2pserve.dht.swarm import Swarm
from p2pserve.helix.scale import five_regions, scale_cluster
from p2pserve.helix.topology import topology_from_helix
from p2pserve.placement.regions import LAN_LATENCY_S
from p2pserve.placement.topology import Topology
from p2pserve.testing.synthetic_swarm import announce_all

MODEL = "llama2_70b"
TARGET_S = 10.0


async def one_round(coord: Swarm, cfg: CoordinatorConfig, epoch: int, parts: bool) -> dict[str, float]:
    """One fresh round, each phase timed; with ``parts`` the solve's parts are timed again apart."""
    t0 = time.perf_counter()
    peers = await coord.get_peers()
    t1 = time.perf_counter()
    links = await coord.get_links()
    t2 = time.perf_counter()
    snap = Snapshot.from_records({pid: s.record for pid, s in peers.items()}, [s.record for s in links.values()])
    t3 = time.perf_counter()
    plan = make_plan(snap, {}, epoch=epoch, leader_id=coord.peer_id, model=MODEL, cfg=cfg,
                     reason=Reason(Trigger.INITIAL), now=wall())
    t4 = time.perf_counter()
    ok = await coord.publish_plan(plan)
    t5 = time.perf_counter()
    out = {"get_peers_s": t1 - t0, "get_links_s": t2 - t1, "snapshot_s": t3 - t2, "read_s": t3 - t0,
           "solve_s": t4 - t3, "publish_s": t5 - t4, "total_s": t5 - t0, "published": float(bool(ok)),
           "peers": float(len(peers)), "links": float(len(snap.links)), "targets": float(len(plan.targets)), "max_flow": plan.max_flow,
           "plan_solve_time_s": plan.solve_time}
    if parts:
        ids = snap.plannable()
        a = time.perf_counter()
        topo, _ = build_topology(snap, ids, cfg)
        b = time.perf_counter()
        plan_targets(topo, ids, {}, cfg, Trigger.INITIAL)
        c = time.perf_counter()
        compute_flows(snap, cfg)
        d = time.perf_counter()
        out.update(topology_s=b - a, targets_s=c - b, flows_s=d - c)
    return out


def bounded(topo: Topology, region_links: int) -> Topology:
    """``topo`` with at most ``region_links`` links inside its region from each node (the first
    by index), as bounded probing announces them (``dht/probe_set.py``: 64 region peers and a
    sample of others); links between regions are all kept (the generator sampled them already)."""
    kept: dict[int, int] = {}
    links = []
    for link in topo.links:
        if 0 <= link.src and 0 <= link.dst and link.latency_s <= LAN_LATENCY_S:
            kept[link.src] = kept.get(link.src, 0) + 1
            if kept[link.src] > region_links:
                continue
        links.append(link)
    return dc_replace(topo, links=tuple(links))


async def bench(n: int, rounds: int, parts: bool, key_dir: Path | None, region_links: int,
                half_serving: bool = False, busy: int = 0) -> dict[str, Any]:
    """Announce ``n`` peers, then ``rounds`` coordinator rounds (``busy`` processes spinning
    meanwhile); with ``half_serving``, every other peer first serves its target of an untimed
    plan, so each round re-solves with newcomers (a fresh plan relabelled onto the current one)."""
    topo = topology_from_helix(scale_cluster(five_regions(n), f"generated{n}", inter_sample=8), MODEL)
    topo = bounded(topo, region_links)
    if key_dir is not None:
        key_dir.mkdir(parents=True, exist_ok=True)
    # making 300 RSA keys takes a minute or two: --key-dir keeps them for the next run
    keys = [load_or_create_key(None if key_dir is None else str(key_dir / f"{i}.key")) for i in range(n)]
    dcfg = DHTConfig(model=MODEL, num_layers=topo.num_layers, host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                     peer_refresh=120.0, link_refresh=600.0, plan_refresh=120.0, candidate_refresh=120.0)
    swarms = identity_swarms(dcfg, keys)
    coord = Swarm.create(replace(dcfg, initial_peers=tuple(swarms[0].visible_maddrs())))
    try:
        announced = await announce_all(swarms, topo, MODEL)
        await coord.announce_candidate(CoordinatorCandidate(model=MODEL, coordinator_id=coord.peer_id,
                                                            start_time=wall(), public_key=coord.public_key))
        ccfg = CoordinatorConfig(num_layers=topo.num_layers, activation_bytes=topo.activation_bytes,
                                 token_bytes=topo.token_bytes)
        if half_serving:
            first = await one_round(coord, ccfg, 1, False)
            signed = (await coord.get_plan()) if first["published"] else None
            plan = signed.plan if signed else None
            serving = {pid: r for x, (pid, r) in enumerate(sorted(plan.targets.items())) if x % 2 == 0} if plan else {}
            await announce_all(swarms, topo, MODEL, serving=serving, links=False)
            print(f"{len(serving)} of {n} peers now serve their targets; the others are newcomers", flush=True)
        out = []
        with loaded_machine(busy):
            for r in range(rounds):
                out.append(await one_round(coord, ccfg, r + 2 if half_serving else r + 1, parts))
                x = out[-1]
                print(f"round {r + 1} ({x['peers']:.0f} peers, {x['links']:.0f} links read): read {x['read_s']:.2f} s (peers {x['get_peers_s']:.2f} + links "
                      f"{x['get_links_s']:.2f} + snapshot {x['snapshot_s']:.2f}), solve {x['solve_s']:.2f} s, "
                      f"publish {x['publish_s']:.2f} s = {x['total_s']:.2f} s ({x['total_s'] / TARGET_S:.2f}x the "
                      f"10 s target)" + (f"; apart: topology {x['topology_s']:.2f} s, targets {x['targets_s']:.2f} s,"
                                         f" flows {x['flows_s']:.2f} s" if parts else ""), flush=True)
        return {"peers": n, "announced": announced, "rounds": out}
    finally:
        coord.shutdown()
        swarms[0].shutdown()


def main() -> None:
    """Run, print the per-phase medians and worst cases, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--parts", action="store_true", help="also time the solve's parts apart (solves twice)")
    ap.add_argument("--region-links", type=int, default=64,
                    help="links each peer announces inside its region (bounded probing: 64)")
    ap.add_argument("--busy", type=int, default=0, help="processes spinning on the CPUs during the rounds (load)")
    ap.add_argument("--half-serving", action="store_true",
                    help="every other peer serves its target of a first, untimed plan: rounds re-solve with newcomers")
    ap.add_argument("--key-dir", type=Path, default=None, help="keep the peers' keys here between runs")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/scale_round.json"))
    args = ap.parse_args()
    res = asyncio.run(bench(args.peers, args.rounds, args.parts, args.key_dir, args.region_links, args.half_serving,
                            args.busy))
    summary = {}
    for k in ("get_peers_s", "get_links_s", "snapshot_s", "read_s", "solve_s", "publish_s", "total_s"):
        xs = [r[k] for r in res["rounds"]]
        summary[k] = {"median": statistics.median(xs), "max": max(xs)}
    res["summary"] = summary
    t = summary["total_s"]
    print(f"{args.peers} peers, {args.rounds} rounds: total median {t['median']:.2f} s, worst {t['max']:.2f} s = "
          f"{t['max'] / TARGET_S:.2f}x the 10 s target; " + ", ".join(
              f"{k[:-2]} {v['median']:.2f}/{v['max']:.2f}" for k, v in summary.items() if k != "total_s"))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
