"""The planner and the control plane at swarm scale, on generated clusters.

For each size (default 100, 300 and 1,000 peers in 5 regions of A100, V100, L4 and T4; LAN inside
a region, 100 Mb/s and 50 ms between regions; every node links to 8 nodes of other regions, as
bounded probing measures; LLaMA-2-70B; default objective):

* ``plan``: :func:`placement.scale.plan_at_scale` -- solve time, time to the first valid plan,
  estimated decode tokens/s, its stitched flow, the upper and covering bounds;
* ``baselines``: Petals-greedy, Swarm-even and separate pipelines on the whole swarm (one
  max-flow over the whole graph each) and, with ``--today S``, today's planner
  (``plan_for_topology``) with an S-second limit, its wall time (it overruns), decode;
* ``replan``: 5% of the peers leave (seeded draw); :func:`placement.scale_churn.replan_after_leave`
  -- time, layers loaded, decode against a fresh :func:`plan_at_scale` of the survivors;
* ``records``: the plan as chunked DHT records (:mod:`dht.plan_chunks`): bytes of the
  largest record against the limit, total bytes, and a delta's bytes after the re-plan.

Ratios are printed against the best baseline measured in the same run. Timings are wall clock on
whatever machine runs it (shared machines: noisy). ``python benchmarks/scale.py --sizes 100 300
1000 --json benchmarks/results/scale.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import scale_swarm  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from p2pserve.dht.plan_chunks import CHUNK_LIMIT_BYTES, delta, encode, route_chunks, split_plan
from p2pserve.dht.records import Flow, Plan, encode_record
from p2pserve.helix.scale import five_regions, scale_cluster
from p2pserve.helix.topology import topology_from_helix
from p2pserve.placement.estimate import WorkloadModel, estimate
from p2pserve.placement.heuristics import petals_greedy, separate_pipelines, swarm_even
from p2pserve.placement.maxflow import FlowResult, max_flow
from p2pserve.placement.moves import by_name
from p2pserve.placement.planner import PlannerConfig, plan_for_topology
from p2pserve.placement.scale import ScaleConfig, cells_by_name, plan_at_scale, region_of_name
from p2pserve.placement.scale_churn import replan_after_leave
from p2pserve.placement.solution import validate_placement
from p2pserve.placement.stitch import stitched_flow
from p2pserve.placement.topology import Topology
from p2pserve.sim.run import SimConfig, simulate
from p2pserve.sim.scenario import Part, build_scenario
from p2pserve.types import SINK, SINK_INDEX, SOURCE, SOURCE_INDEX

MODEL = "llama2_70b"


def _evaluate(topo: Topology, placement: dict[int, tuple[int, int]]) -> dict[str, float]:
    """Max-flow over the whole graph and the decode estimate of a placement."""
    t = time.perf_counter()
    fr = max_flow(topo, placement)
    est = estimate(topo, placement, fr)
    return {"max_flow": fr.value, "decode": est.decode_tokens_per_s, "eval_s": time.perf_counter() - t,
            "valid": not validate_placement(topo, placement)}


def routed_estimate(topo: Topology, placement: dict[int, tuple[int, int]], flow: FlowResult) -> float:
    """The decode estimate of ``placement`` routed by ``flow`` (the flows it publishes), with the
    scheduler's alternation between twins counted where it happens: a node counts as a twin when
    a node of the same range shares an upstream node with it in ``flow`` (the estimate's weight
    rescaled to that share, as :func:`stitch.cell_workload` does for cells). One function of
    (placement, published flows) for every plan, cheap where the simulator is not."""
    succ: dict[int, set[int]] = {}
    for (u, v), f in flow.edge_flows.items():
        if f > 1e-6 and v >= 0:
            succ.setdefault(u, set()).add(v)
    twins: set[int] = set()
    for vs in succ.values():
        by_range: dict[tuple[int, int], list[int]] = {}
        for v in vs:
            by_range.setdefault(placement[v], []).append(v)
        twins.update(v for g in by_range.values() if len(g) > 1 for v in g)
    counts = Counter(placement.values())
    anywhere = sum(1 for r in placement.values() if counts[r] > 1) / len(placement)
    model = WorkloadModel()
    if anywhere > 0:
        model = replace(model, aligned_weight=model.aligned_weight * len(twins) / len(placement) / anywhere)
    return estimate(topo, placement, flow, model).decode_tokens_per_s


#: The clusters of the issue that measured today's planner at scale (complete graphs, as
#: ``cluster_text`` writes them), with today's figures there: (decode, wall s) at a 120 s limit.
ISSUE_CLUSTERS = {
    "issue120": ([[("A100", 8), ("L4", 8), ("T4", 8)]] * 5, (2213.0, 108.0)),
    "issue256": ([[("A100", 16), ("V100", 16), ("L4", 16), ("T4", 16)]] * 4, (2895.0, 181.0)),
}


def bench_issue(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """``plan_at_scale`` and the greedy baselines on one of :data:`ISSUE_CLUSTERS`."""
    regions, (today, today_s) = ISSUE_CLUSTERS[name]
    topo = topology_from_helix(scale_cluster(regions, name, inter_sample=None), MODEL)
    sol = plan_at_scale(topo, PlannerConfig(seed=args.seed),
                        ScaleConfig(cell_work=args.cell_work, time_limit_s=args.time_limit))
    base = {"petals": petals_greedy(topo), "swarm": swarm_even(topo), "separate": separate_pipelines(topo)}
    out = {"cluster": name, "peers": topo.num_nodes, "solve_s": sol.solve_time_s,
           "decode": sol.estimate.decode_tokens_per_s, "today_decode_120s": today, "today_wall_s": today_s,
           "decode_whole": _evaluate(topo, sol.assignments)["decode"],
           "baselines": {k: _evaluate(topo, p) for k, p in base.items()}}
    best = max(v["decode"] for v in out["baselines"].values())
    whole = out["decode_whole"]
    print(f"{name}: solve {sol.solve_time_s:.1f} s; whole-swarm estimate (as today's planner and the baselines are "
          f"scored) {whole:.0f} = {whole / today:.2f}x today's planner at 120 s ({today:.0f}, {today_s:.0f} s wall, "
          f"from its own run), {whole / best:.2f}x the best greedy baseline measured now ({best:.0f}); its own "
          f"stitched estimate {out['decode']:.0f}")
    return out


def bench_size(n: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every planner figure for one generated cluster of ``n`` peers."""
    out: dict[str, Any] = {"peers": n}
    t = time.perf_counter()
    cluster = scale_cluster(five_regions(n), f"generated{n}", inter_sample=args.inter_sample)
    topo = topology_from_helix(cluster, MODEL)
    out["build_s"] = time.perf_counter() - t
    out["links"] = len(topo.links)
    cfg = PlannerConfig(seed=args.seed)
    scale = ScaleConfig(cell_work=args.cell_work, time_limit_s=args.time_limit)
    sol = plan_at_scale(topo, cfg, scale)
    out["plan"] = {"solve_s": sol.solve_time_s, "decode": sol.estimate.decode_tokens_per_s,
                   "stitched_flow": sol.max_flow, "upper_bound": sol.upper_bound,
                   "covering_bound": sol.covering_bound, "mean_depth": sol.estimate.mean_depth,
                   **{k: v for k, v in sol.stats["scale"].items() if k != "cell_names"}}
    base = {"petals": petals_greedy(topo), "swarm": swarm_even(topo), "separate": separate_pipelines(topo)}
    out["baselines"] = {k: _evaluate(topo, p) for k, p in base.items()}
    if args.today:
        out["baselines"]["today"] = today_baseline(topo, args)
        base["today"] = out["baselines"]["today"].pop("assignments")
    best = max(v["decode"] for v in out["baselines"].values())
    out["plan"]["decode_over_best_baseline"] = sol.estimate.decode_tokens_per_s / best if best > 0 else None
    # the same placement under the estimate every baseline gets (one max-flow over the whole
    # graph, twins counted across the swarm): the like-for-like comparison
    whole = _evaluate(topo, sol.assignments)
    out["plan"]["decode_whole"] = whole["decode"]
    out["plan"]["decode_whole_over_best_baseline"] = whole["decode"] / best if best > 0 else None
    out["routed"] = {"plan": routed_estimate(topo, sol.assignments, stitched_flow(sol.flows))}
    out["routed"].update({k: routed_estimate(topo, p, max_flow(topo, p)) for k, p in base.items()})
    others = [v for k, v in out["routed"].items() if k != "plan"]
    out["routed"]["plan_over_best"] = out["routed"]["plan"] / max(others) if max(others) > 0 else None
    if args.sim:
        out["sim"] = bench_sim(cluster, sol, base, args.sim)
    out["replan"], replanned = bench_replan(topo, sol, cfg, scale, args)
    out["records"] = bench_records(sol, replanned)
    return out


def bench_sim(cluster: Any, sol: Any, base: dict[str, dict[int, tuple[int, int]]], window: float) -> dict[str, Any]:
    """Every plan in the project's simulator, the one figure applied to all of them.

    Offline, IWRR, Helix's batch caps, 60 s warm-up + ``window`` s, sim seed 0 (the setting of
    ``scale_helix.py --sim``). Each plan is routed by the flows it publishes: ``plan_at_scale``'s
    stitched cell flows (a route stays in its cell), the others' max-flow over the whole swarm.
    """
    def run(placement: dict[int, tuple[int, int]], flows: Any = None) -> float | None:
        sc = build_scenario(MODEL, [Part(cluster, dict(placement))])
        if flows is not None:
            sc = replace(sc, flows=dict(flows))
        res = simulate(sc, SimConfig(duration=window, warmup=60.0, seed=0))
        # None: the scheduler found no route at all. Helix's IWRR ignores every edge under 5 % of
        # its tail's outflow, the source's included, so a plan whose clients enter through more
        # than 20 peers evenly (1,000 peers) has no routable edge out of the source.
        return res.decode_throughput_tokens_per_s if res.avg_route_depth > 0 else None

    out: dict[str, Any] = {"window_s": window}
    for name, placement, flows in [("plan", sol.assignments, sol.flows)] + [(k, p, None) for k, p in base.items()]:
        t = time.perf_counter()
        out[name] = run(placement, flows)
        print(f"   simulated {name}: " + ("no route (the simulator's scheduler masks every edge out of the source)"
                                          if out[name] is None else f"{out[name]:.0f} decode tok/s")
              + f" ({time.perf_counter() - t:.0f} s wall)", flush=True)
    others = [v for k, v in out.items() if k not in ("plan", "window_s") and v is not None]
    best = max(others, default=0.0)
    out["plan_over_best"] = out["plan"] / best if best > 0 and out["plan"] is not None else None
    return out


def today_baseline(topo: Topology, args: argparse.Namespace) -> dict[str, Any]:
    """Today's planner (``plan_for_topology`` on the whole swarm) with an ``args.today``-second limit.

    Its plan is kept in ``args.today_cache`` (by node name, with the cluster's digest, the seed
    and the limit): a later run on the same inputs re-scores that plan instead of spending the
    limit again (``--no-today-cache`` solves afresh). The figures are the whole-swarm ones every
    plan gets here (:func:`_evaluate`); ``wall_s`` is the solve's own, from the run that made it.
    """
    key = {"cluster": _topology_digest(topo), "seed": args.seed, "limit_s": args.today}
    path = args.today_cache.parent / f"{args.today_cache.stem}_{topo.num_nodes}{args.today_cache.suffix}"
    cached = json.loads(path.read_text()) if args.use_today_cache and path.exists() else None
    if cached is None or cached.get("key") != key:
        t = time.perf_counter()
        today = plan_for_topology(topo, PlannerConfig(seed=args.seed, time_limit_s=args.today))
        names = {topo.nodes[i].name: list(r) for i, r in today.assignments.items()}
        cached = {"key": key, "wall_s": time.perf_counter() - t, "assignments": names,
                  "own_decode": today.estimate.decode_tokens_per_s}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached))
    index = {n.name: i for i, n in enumerate(topo.nodes)}
    placement = {index[n]: (int(r[0]), int(r[1])) for n, r in cached["assignments"].items()}
    return {**_evaluate(topo, placement), "wall_s": cached["wall_s"], "limit_s": args.today,
            "assignments": placement}


def _topology_digest(topo: Topology) -> str:
    """A short digest of what a plan of ``topo`` depends on (nodes and links, not timings)."""
    h = hashlib.sha256()
    h.update(repr((topo.num_layers, [(n.name, n.max_layers, tuple(n.throughput)) for n in topo.nodes])).encode())
    h.update(repr(sorted((l.src, l.dst, l.bandwidth, l.latency_s) for l in topo.links)).encode())
    return h.hexdigest()[:16]


def _peer_id(name: str) -> str:
    """A libp2p-length peer id (52 characters) for a node name, so record sizes are realistic."""
    return ("12D3KooW" + hashlib.sha256(name.encode()).hexdigest())[:52]


def _wire_plan(sol: Any, epoch: int) -> Plan:
    """A solution as the wire Plan a coordinator would publish (targets = spans = ranges)."""
    names = {i: _peer_id(n) for i, n in sol.node_names.items()}

    def end(i: int) -> str:
        return SOURCE if i == SOURCE_INDEX else SINK if i == SINK_INDEX else names[i]

    ranges = {names[i]: r for i, r in sol.assignments.items()}
    flows = [Flow(end(u), end(v), float(f)) for (u, v), f in sorted(sol.flows.items()) if f > 0]
    return Plan(model=MODEL, epoch=epoch, leader_id=_peer_id("leader"), num_layers=80, targets=ranges, spans=ranges,
                flows=flows, max_flow=sol.max_flow, upper_bound=sol.upper_bound, created_at=1.8e9)


def bench_records(sol: Any, replanned: Any) -> dict[str, Any]:
    """The plan as one record and as chunks per region; the delta after the re-plan."""
    groups = {_peer_id(n): g for n, g in region_of_name(sol).items()}
    plan = _wire_plan(sol, 1)
    index, chunks = split_plan(plan, groups)
    sizes = [len(encode(c)) for c in chunks]
    after = _wire_plan(replanned, 2)
    index2, chunks2 = split_plan(after, groups)
    index2, fresh = delta(index, index2, chunks2)
    return {"single_plan_bytes": len(encode_record(plan)), "chunks": len(chunks), "largest_chunk_bytes": max(sizes),
            "total_chunk_bytes": sum(sizes), "index_bytes": len(encode(index)), "limit_bytes": CHUNK_LIMIT_BYTES,
            "all_fit": max(sizes) <= CHUNK_LIMIT_BYTES, "route_bytes": len(encode(index)) + sum(
                len(encode(c)) for c in chunks if c.name in set(route_chunks(index))),
            "delta_chunks": len(fresh), "delta_bytes": len(encode(index2)) + sum(len(encode(c)) for c in fresh)}


def bench_replan(topo: Topology, sol: Any, cfg: PlannerConfig, scale: ScaleConfig,
                 args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """5% of the peers leave: the re-plan against a fresh plan of the survivors."""
    rng = random.Random(args.seed)
    gone = sorted(rng.sample(range(topo.num_nodes), max(1, round(0.05 * topo.num_nodes))))
    after, _keep = topo.without(gone)
    current = by_name(topo, sol.assignments)
    r = replan_after_leave(after, current, cells_by_name(sol), cfg, work=args.replan_work,
                           covering_bound=sol.covering_bound)
    fresh = plan_at_scale(after, cfg, scale)
    actions: dict[str, int] = {}
    for rep in r.repairs:
        actions[rep.action] = actions.get(rep.action, 0) + 1
    return {"left": len(gone), "replan_s": r.elapsed_s, "layers_moved": r.layers_moved,
            "decode": r.plan.estimate.decode_tokens_per_s, "fresh_decode": fresh.estimate.decode_tokens_per_s,
            "fresh_s": fresh.solve_time_s, "decode_over_fresh": r.plan.estimate.decode_tokens_per_s
            / max(fresh.estimate.decode_tokens_per_s, 1e-9),
            "valid": not validate_placement(after, r.plan.assignments), "cells": actions}, r.plan


def report(n: int, r: dict[str, Any]) -> None:
    """Print one size's figures: every plan scored alike (the whole-swarm estimate, and with
    ``--sim`` the simulator), then the plan's own stitched estimate, records and re-plan."""
    p, rp = r["plan"], r["replan"]
    best = max(r["baselines"], key=lambda k: r["baselines"][k]["decode"])
    print(f"{n} peers: solve {p['solve_s']:.1f} s (first valid {p['first_valid_s']:.1f} s); whole-swarm estimate "
          f"(every plan alike) {p['decode_whole']:.0f} tok/s = {p['decode_whole_over_best_baseline']:.2f}x the best "
          f"other plan ({best} {r['baselines'][best]['decode']:.0f}); its own stitched estimate {p['decode']:.0f}; "
          f"stitched flow {p['stitched_flow']:.0f} / covering bound {p['covering_bound']:.0f} = "
          f"{p['stitched_flow'] / p['covering_bound']:.2f}")
    rt = r["routed"]
    print(f"   routed estimate (each plan by the flows it publishes, twins where they share an upstream node): "
          f"{rt['plan']:.0f} tok/s = {rt['plan_over_best']:.2f}x the best other plan; "
          + ", ".join(f"{k} {v:.0f}" for k, v in rt.items() if k not in ("plan", "plan_over_best")))
    if "sim" in r and r["sim"]["plan_over_best"] is not None:
        sm = r["sim"]
        others = {k: v for k, v in sm.items() if k not in ("plan", "window_s", "plan_over_best") and v is not None}
        top = max(others, key=lambda k: others[k])
        print(f"   simulated (60 s + {sm['window_s']:.0f} s, every plan alike): {sm['plan']:.0f} tok/s = "
              f"{sm['plan_over_best']:.2f}x the best other plan ({top} {others[top]:.0f}); "
              + ", ".join(f"{k} {v:.0f}" for k, v in others.items()))
    if "today" in r["baselines"]:
        td = r["baselines"]["today"]
        print(f"   today's planner given {td['limit_s']:.0f} s: {td['wall_s']:.0f} s wall, whole-swarm estimate "
              f"{td['decode']:.0f} tok/s" + (f", simulated {r['sim']['today']:.0f}" if r.get("sim", {}).get("today") else ""))
    rc = r["records"]
    print(f"   records: one plan {rc['single_plan_bytes']} B; {rc['chunks']} chunks, largest {rc['largest_chunk_bytes']}"
          f" B of {rc['limit_bytes']} (all fit: {rc['all_fit']}); a client's route reads {rc['route_bytes']} B; "
          f"re-plan delta {rc['delta_chunks']} chunks, {rc['delta_bytes']} B")
    print(f"   re-plan after {rp['left']} leave: {rp['replan_s']:.2f} s, {rp['layers_moved']} layers loaded, "
          f"decode {rp['decode_over_fresh']:.2f}x a fresh plan ({rp['fresh_s']:.1f} s)")


def main() -> None:
    """Run the sizes asked for, print the ratios, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[100, 300, 1000])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cell-work", type=int, default=ScaleConfig().cell_work)
    ap.add_argument("--time-limit", type=float, default=ScaleConfig().time_limit_s)
    ap.add_argument("--replan-work", type=int, default=300, help="search evaluations for a whole re-plan")
    ap.add_argument("--inter-sample", type=int, default=8)
    ap.add_argument("--today", type=float, default=0.0,
                    help="also run today's planner (plan_for_topology on the whole swarm) with this time limit in "
                         "seconds as a baseline; the acceptance's is 600 (0: skip)")
    ap.add_argument("--sim", type=float, default=0.0, metavar="WINDOW",
                    help="also simulate every plan (ours with its stitched flows, the baselines and today's with "
                         "their max-flow) over 60 s + WINDOW s: the figure applied alike to all (0: skip; about a "
                         "minute per plan at 256 peers for 240 s)")
    ap.add_argument("--today-cache", type=Path, default=Path("benchmarks/results/scale_today.json"),
                    help="where today's plan is kept per size (FILE_<peers>.json) and re-scored from on the same "
                         "inputs")
    ap.add_argument("--no-today-cache", dest="use_today_cache", action="store_false",
                    help="solve today's planner afresh even when a cached plan matches")
    ap.add_argument("--swarm", type=int, nargs="*", default=[300],
                    help="synthetic swarm sizes (announced peers, real DHT nodes); none: skip")
    ap.add_argument("--issue", nargs="*", default=[], choices=sorted(ISSUE_CLUSTERS),
                    help="also plan these complete-graph clusters (today's planner was measured on them)")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/scale.json"))
    args = ap.parse_args()
    results = {"sizes": []}
    for n in args.sizes:
        r = bench_size(n, args)
        results["sizes"].append(r)
        report(n, r)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1, default=str))
    results["issue"] = [bench_issue(name, args) for name in args.issue]
    args.json.write_text(json.dumps(results, indent=1, default=str))
    results["swarm"] = []
    for n in args.swarm:
        topo = topology_from_helix(scale_cluster(five_regions(n), f"generated{n}", inter_sample=args.inter_sample),
                                   MODEL)
        r = scale_swarm.run(topo, MODEL)
        results["swarm"].append(r)
        r1, r2, c = r["round1"], r["round2"], r["client"]
        print(f"synthetic swarm of {n} announced peers: round 1 read {r1['read_s']:.2f} s + solve {r1['solve_s']:.2f} s"
              f" + publish {r1['publish_s']:.2f} s = {r1['total_s']:.2f} s (target 10 s: {r1['total_s'] / 10:.2f}x);"
              f" round 2 {r2['total_s']:.2f} s; one Plan record would be {r2['single_plan_bytes']} B "
              f"({r2['defaulted_links']} defaulted links), {r2['chunks']} chunks, largest {r2['largest_chunk_bytes']} B;"
              f" client's first route {c['route_s']:.2f} s (target 1 s; {c['route_hops']} hops, "
              f"{c['peers_read']} peers read), reading every chunk {r['client_full']['route_s']:.2f} s")
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
