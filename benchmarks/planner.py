"""Planner benchmark: methods x clusters, churn, unseen clusters, and a simulator check.

Run from the repository root::

    python benchmarks/planner.py            # full run: 60 s per solve (about 20 minutes)
    python benchmarks/planner.py --quick    # 10 s per solve, fewer sims (a few minutes)

Prints tables and writes ``benchmarks/results/planner.json``. Timings are wall-clock on
whatever machine runs it (this project's reference: 2 shared cores).

Sections:

* ``methods`` -- ours (max-flow objective, and the default throughput objective), Petals-greedy,
  Swarm-even, separate pipelines, the balanced chain, and the authors' Helix placement, on
  cluster24 (LLaMA-2-70B) and cluster10 (LLaMA-1-30B): max-flow, ratio to the best-known result
  (1,289.56 / 286.587), ratio to the upper bound, solve time, solver gap, estimated decode.
* ``churn`` -- cluster24 from our plan for each objective: 1, 2, 4 random nodes removed and 2
  added; time to a valid plan, share of a full re-solve's max-flow, layers moved (ours vs full
  re-solve), and whether the target is reachable at all: the proven fewest layers any placement
  must load for 95 % of the full re-solve's max-flow, and (max-flow objective) the proven ceiling
  on the share within a quarter of the full re-solve's moves (``move_bound``, ``tools/move_ceiling.py``).
* ``unseen`` -- generated clusters (random GPU mix, heterogeneous links) never used to tune.
* ``backends`` -- when the ``ortools`` extra is installed: HiGHS against CP-SAT on the placement
  MILP with the same warm starts (incumbent, bound, status, time).
* ``reproducibility`` -- (``planner_repro.py``) ``--runs`` solves at one seed with a ``--work``
  budget while ``--burners`` processes load the machine: how many distinct placements (goal: 1);
  then ``--seeds`` seeds simulated: worst over median (goal: >= 0.9), median over Helix's placement.
* ``estimate_check`` -- (``planner_estimate.py``) the decode estimate against the simulator on
  held-back placements (other clusters, other planner and simulator seeds, perturbations): mean
  and max error, bias and Spearman per cluster (``--check-seeds``, ``--check-perturbations``).
* ``simulator`` -- simulated decode throughput (offline, IWRR, 600 s window) of the authors' Helix
  placement and of our throughput plan on cluster24.
* ``versus_helix`` -- (``planner_repro.py``) our plan against Helix's on cluster24 and the paper's
  geo-distributed and high-heterogeneity clusters, ``--versus-seeds`` seeds at ``--work``: Helix =
  our planner with the max-flow objective (same seed and work), and the authors' placement on
  cluster24. The reproducibility section covers these two clusters too. Our plan goes through the
  publish guard with a ``--check-window`` second simulation (0: off), ``--refine-checks`` climbs on it.
* ``bottleneck`` -- (``planner_bottleneck.py``) what limits our cluster24 placement and Helix's in
  the simulator: prefill interference, KV (requests in flight), compute; ``--bottleneck-climb N``
  adds a simulator-scored hill-climb from our plan.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from p2pserve.helix import format as hf  # noqa: E402
from p2pserve.helix.root import data_root  # noqa: E402
from p2pserve.helix.throughput import throughput_table  # noqa: E402
from p2pserve.helix.topology import helix_node_spec, load_helix_topology  # noqa: E402
from p2pserve.placement.estimate import estimate  # noqa: E402
from p2pserve.placement.heuristics import petals_greedy, separate_pipelines, swarm_even  # noqa: E402
from p2pserve.placement.maxflow import max_flow  # noqa: E402
from p2pserve.placement.planner import PlannerConfig, plan_for_topology  # noqa: E402
from p2pserve.placement.search import balanced_chain  # noqa: E402
from p2pserve.placement.solution import validate_placement  # noqa: E402
from p2pserve.placement.topology import LinkSpec, Topology  # noqa: E402
from p2pserve.sim.run import SimConfig, simulate  # noqa: E402
from p2pserve.sim.scenario import Part, build_scenario  # noqa: E402
from p2pserve.types import SINK_INDEX, SOURCE_INDEX  # noqa: E402
from planner_bottleneck import bottleneck_section, print_bottleneck  # noqa: E402  (this directory is on sys.path)
from planner_churn import churn_section  # noqa: E402  (this directory is on sys.path when run)
from planner_estimate import estimate_check_section, print_estimate_check  # noqa: E402
from planner_repro import (  # noqa: E402
    REPRO_CLUSTERS,
    VERSUS_CLUSTERS,
    print_reproducibility,
    reproducibility_section,
    versus_helix_section,
)

BEST_KNOWN = {"cluster24": 1289.56, "cluster10": 286.587}
CLUSTERS = {
    "cluster24": ("clusters/single_cluster/cluster24.ini", "llama2-70b",
                  "layouts/single_cluster/llama70b/ilp/ilp_sol.ini"),
    "cluster10": ("clusters/ablation/cluster10.ini", "llama1-30b", "layouts/ablation/quality/ilp_sol.ini"),
}


def row(topo, name, placement, seconds, gap=None, best_known=None, method=None):
    """One result row for a placement."""
    fr = max_flow(topo, placement)
    est = estimate(topo, placement, fr)
    return {
        "method": name,
        "max_flow": round(fr.value, 3),
        "ratio_best_known": round(fr.value / best_known, 4) if best_known else None,
        "ratio_upper_bound": round(fr.value / topo.upper_bound(), 4),
        "ratio_covering_bound": round(fr.value / topo.covering_upper_bound(), 4),
        "solve_time_s": round(seconds, 2),
        "solver_gap": None if gap is None else round(gap, 4),
        "est_decode_tokens_per_s": round(est.decode_tokens_per_s, 1),
        "est_latency_s": round(est.per_token_latency_s, 3),
        "mean_depth": round(est.mean_depth, 2),
        "valid": not validate_placement(topo, placement),
        "detail": method,
    }


def timed(fn):
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def bench_methods(tl: float) -> dict:
    out = {}
    data = data_root()
    for cname, (path, model, sol) in CLUSTERS.items():
        topo = load_helix_topology(data / path, model)
        best = BEST_KNOWN[cname]
        rows = []
        plan, _ = timed(lambda: plan_for_topology(topo, PlannerConfig(objective="max-flow", time_limit_s=tl)))
        rows.append(row(topo, "ours (max-flow)", plan.assignments, plan.solve_time_s, plan.solver_gap, best, plan.method))
        tplan, _ = timed(lambda: plan_for_topology(topo, PlannerConfig(objective="throughput", time_limit_s=tl)))
        rows.append(row(topo, "ours (throughput)", tplan.assignments, tplan.solve_time_s, tplan.solver_gap, best, tplan.method))
        for name, fn in (("petals", petals_greedy), ("swarm", swarm_even), ("separate", separate_pipelines),
                         ("balanced chain", balanced_chain)):
            p, secs = timed(lambda: fn(topo))
            rows.append(row(topo, name, p, secs, None, best))
        rows.append(row(topo, "helix (authors' layout)", hf.load_solution(data / sol), 0.0, None, best))
        out[cname] = {
            "rows": rows,
            "upper_bound": topo.upper_bound(),
            "covering_bound": topo.covering_upper_bound(),
            "throughput_plan": {str(i): list(r) for i, r in tplan.assignments.items()},
            "max_flow_plan": {str(i): list(r) for i, r in plan.assignments.items()},
            "milp": plan.stats.get("milp"),
        }
    return out


def bench_backends(tl: float) -> list[dict] | None:
    """HiGHS against CP-SAT on the placement MILP: the same model and warm starts (none,
    Petals-greedy, the balanced chain) on both clusters; incumbent max-flow, bound, status and
    time of each, and the ratio of CP-SAT's bound to HiGHS's. None when ``ortools`` (the
    optional extra) is not installed."""
    from p2pserve.placement.milp import MilpOptions, solve_milp
    from p2pserve.placement.milp.backends import cpsat_available

    if not cpsat_available():
        return None
    rows = []
    data = data_root()
    for cname, (path, model, _) in CLUSTERS.items():
        topo = load_helix_topology(data / path, model)
        for start_name, start in (("none", None), ("petals", petals_greedy(topo)), ("balanced chain", balanced_chain(topo))):
            out = {"cluster": cname, "start": start_name}
            for backend in ("highs", "cpsat"):
                res = solve_milp(topo, tl, MilpOptions(), warm_starts=[start] if start else None, backend=backend)
                out.update({f"{backend}_max_flow": round(res.objective, 2), f"{backend}_bound": round(res.bound, 2),
                            f"{backend}_status": res.status, f"{backend}_s": round(res.solve_time_s, 1)})
            out["cpsat_vs_highs_bound"] = round(out["cpsat_bound"] / out["highs_bound"], 4) if out["highs_bound"] else None
            rows.append(out)
    return rows


def generated_topology(n: int, seed: int, model: str = "llama2-70b") -> Topology:
    """A random cluster: GPU types from the profiles, 2 regions, slow links between them."""
    rng = random.Random(seed)
    types = ["A100", "L4", "T4", "V100", "L4x2", "T4x2"]
    node_types = [rng.choice(types) for _ in range(n)]
    tables = throughput_table(model, node_types)
    mp = hf.load_machine_params(model)
    nodes = tuple(
        helix_node_spec(f"gen{seed}-{i}", t, tables[mp.gpu(t).name], model) for i, t in enumerate(node_types)
    )
    region = [rng.random() < 0.5 for _ in range(n)]
    links = []
    for i in range(n):
        links.append(LinkSpec(SOURCE_INDEX, i, 1e9, 1e-3))
        links.append(LinkSpec(i, SINK_INDEX, 1e9, 1e-3))
        for j in range(n):
            if i == j:
                continue
            same = region[i] == region[j]
            bw = rng.uniform(0.5e9, 2e9) if same else rng.uniform(2e7, 1e8)  # helix convention
            lat = rng.uniform(1e-3, 3e-3) if same else rng.uniform(20e-3, 60e-3)
            links.append(LinkSpec(i, j, bw, lat))
    return Topology(nodes, tuple(links), num_layers=mp.num_layers, activation_bytes=mp.activation_size_bytes,
                    token_bytes=mp.token_size_bytes, layer_bytes=mp.layer_param_bytes, model=model,
                    name=f"generated-{n}-{seed}")


def bench_unseen(tl: float) -> list[dict]:
    rows = []
    for n, seed in ((12, 101), (20, 202), (32, 303)):
        topo = generated_topology(n, seed)
        if topo.total_memory_layers() < topo.num_layers:
            continue
        plan = plan_for_topology(topo, PlannerConfig(objective="max-flow", time_limit_s=tl))
        tplan = plan_for_topology(topo, PlannerConfig(objective="throughput", time_limit_s=tl))
        entry = {"cluster": topo.name, "nodes": n, "covering_bound": round(topo.covering_upper_bound(), 2),
                 "rows": [row(topo, "ours (max-flow)", plan.assignments, plan.solve_time_s, plan.solver_gap),
                          row(topo, "ours (throughput)", tplan.assignments, tplan.solve_time_s)]}
        for name, fn in (("petals", petals_greedy), ("swarm", swarm_even), ("separate", separate_pipelines),
                         ("balanced chain", balanced_chain)):
            p = fn(topo)
            if p and not validate_placement(topo, p):
                entry["rows"].append(row(topo, name, p, 0.0))
        rows.append(entry)
    return rows


def bench_simulator(placements: dict[str, dict], duration: float) -> dict:
    data = data_root()
    cl = hf.load_cluster(data / CLUSTERS["cluster24"][0])
    out = {}
    for name, placement in placements.items():
        sc = build_scenario("llama2-70b", [Part(cl, placement)])
        res = simulate(sc, SimConfig(duration=duration, warmup=60.0)).to_dict()
        out[name] = {
            "decode_tokens_per_s": round(res["decode_throughput_tokens_per_s"], 2),
            "decode_latency_s": round(res["decode_latency_s"]["mean"], 3),
            "avg_route_depth": round(res.get("avg_route_depth", 0.0), 2),
        }
    if "helix" in out:
        for v in out.values():
            v["ratio_to_helix"] = round(v["decode_tokens_per_s"] / out["helix"]["decode_tokens_per_s"], 3)
    return out


def print_table(title: str, rows: list[dict], cols: list[str]) -> None:
    print(f"\n== {title}")
    widths = [max(len(c), *(len(str(r.get(c))) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r.get(c)).ljust(w) for c, w in zip(cols, widths)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The benchmark's flags."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10 s solves, 120 s simulator window")
    ap.add_argument("--time-limit", type=float, default=None)
    ap.add_argument("--skip", nargs="*", default=[],
                    choices=["methods", "churn", "unseen", "simulator", "backends", "reproducibility", "versus_helix",
                             "estimate_check", "bottleneck"])
    ap.add_argument("--runs", type=int, default=10, help="reproducibility: solves at one seed")
    ap.add_argument("--seeds", type=int, default=10, help="reproducibility: seeds simulated")
    ap.add_argument("--work", type=int, default=20000, help="reproducibility: evaluations per solve")
    ap.add_argument("--versus-seeds", type=int, default=3, help="versus_helix: seeds per cluster")
    ap.add_argument("--check-window", type=float, default=240.0,
                    help="reproducibility, versus_helix: the publish guard's simulated window in seconds (0: no guard)")
    ap.add_argument("--refine-checks", type=int, default=0,
                    help="reproducibility, versus_helix: simulated checks the planner climbs on after its search")
    ap.add_argument("--versus-clusters", nargs="+", default=list(VERSUS_CLUSTERS), choices=list(VERSUS_CLUSTERS),
                    help="versus_helix: clusters to compare on")
    ap.add_argument("--repro-clusters", nargs="+", default=list(REPRO_CLUSTERS), choices=list(REPRO_CLUSTERS),
                    help="reproducibility: clusters to run (--runs 0 skips the same-seed runs under load)")
    ap.add_argument("--check-seeds", type=int, nargs="+", default=[1, 2],
                    help="estimate_check: planner seeds whose plans (and their perturbations) are held back")
    ap.add_argument("--check-perturbations", type=int, default=3, help="estimate_check: perturbations per plan")
    ap.add_argument("--burners", type=int, default=2, help="reproducibility: busy processes loading the machine")
    ap.add_argument("--reload-share", type=float, nargs="+", default=[5e-3],
                    help="churn: reload cost per moved layer, as a share of the objective (several: a sweep)")
    ap.add_argument("--tolerance", type=float, nargs="+", default=[0.0],
                    help="churn: fewest moves within this share of the best objective found (0: price only; several: a sweep)")
    ap.add_argument("--lane-check", type=float, default=0.0, metavar="SECONDS",
                    help="churn: also search the lane neighbourhood exhaustively for this long per scenario")
    ap.add_argument("--objective", nargs="+", default=["max-flow", "throughput"], choices=["max-flow", "throughput"],
                    help="churn: objectives to run")
    ap.add_argument("--bottleneck-seeds", type=int, nargs="+", default=[0, 1],
                    help="bottleneck: simulator seeds each change is measured at (mean)")
    ap.add_argument("--bottleneck-climb", type=int, default=0,
                    help="bottleneck: checks of the simulator-scored hill-climb from our plan (0: skip)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "planner.json"))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tl = args.time_limit or (10.0 if args.quick else 60.0)
    report: dict = {"time_limit_s": tl, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    cols = ["method", "max_flow", "ratio_best_known", "ratio_upper_bound", "solve_time_s", "solver_gap",
            "est_decode_tokens_per_s", "mean_depth", "valid"]
    if "methods" not in args.skip:
        report["methods"] = bench_methods(tl)
        for cname, res in report["methods"].items():
            print_table(f"{cname} (best known {BEST_KNOWN[cname]}, upper bound {res['upper_bound']:.2f})",
                        res["rows"], cols)
    if "churn" not in args.skip:
        report["churn"] = churn_section(args, tl, print_table)
    if "backends" not in args.skip:
        rows = bench_backends(min(tl, 30.0))
        if rows is None:
            print("\n== MILP backends: skipped (ortools, the optional extra, is not installed)")
        else:
            report["backends"] = rows
            print_table("MILP backends: HiGHS vs CP-SAT, same model and warm starts", rows,
                        ["cluster", "start", "highs_max_flow", "highs_bound", "highs_s", "cpsat_max_flow",
                         "cpsat_bound", "cpsat_status", "cpsat_s", "cpsat_vs_highs_bound"])
    if "unseen" not in args.skip:
        report["unseen"] = bench_unseen(min(tl, 20.0))
        for entry in report["unseen"]:
            print_table(f"{entry['cluster']} (covering bound {entry['covering_bound']})", entry["rows"],
                        ["method", "max_flow", "ratio_covering_bound", "solve_time_s", "est_decode_tokens_per_s",
                         "mean_depth", "valid"])
    if "simulator" not in args.skip:
        report["simulator"] = simulator_section(report, args.quick)
    if "reproducibility" not in args.skip:
        report["reproducibility"] = reproducibility_section(args.runs, args.seeds, args.work, args.burners,
                                                            120.0 if args.quick else 600.0,
                                                            check_window=args.check_window,
                                                            refine_checks=args.refine_checks,
                                                            clusters=args.repro_clusters)
        print_reproducibility(report["reproducibility"], print_table)
    if "versus_helix" not in args.skip:
        print("\n== ours vs Helix, simulated decode tok/s (70B offline IWRR), per seed ==")
        report["versus_helix"] = versus_helix_section(args.versus_seeds, args.work, 120.0 if args.quick else 600.0,
                                                      check_window=args.check_window,
                                                      refine_checks=args.refine_checks,
                                                      clusters=args.versus_clusters)
    if "estimate_check" not in args.skip:
        print("\n== decode estimate vs simulator, held-back placements (70B offline IWRR, sim seed 1) ==")
        report["estimate_check"] = estimate_check_section(args.check_seeds, args.work, 120.0 if args.quick else 600.0,
                                                          args.check_perturbations)
        print_estimate_check(report["estimate_check"], print_table)
    if "bottleneck" not in args.skip:
        print("\n== what limits our placement on cluster24, one change at a time (simulated) ==")
        report["bottleneck"] = bottleneck_section(args.work, 120.0 if args.quick else 600.0, args.bottleneck_seeds,
                                                  args.bottleneck_climb)
        print_bottleneck(report["bottleneck"], print_table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # A run with --skip updates the sections it ran and keeps the others' last results.
    previous = json.loads(out.read_text()) if out.exists() else {}
    merged = {**previous, **{k: {**previous[k], **v} if isinstance(previous.get(k), dict) and isinstance(v, dict)
                             else v for k, v in report.items()}}  # e.g. versus_helix run cluster by cluster
    out.write_text(json.dumps(merged, indent=2))
    print(f"\nwrote {out}")
    return 0


def simulator_section(report: dict, quick: bool) -> dict:
    """Simulate the authors' placement and (after ``methods``) our two plans; print the table."""
    placements = {"helix": hf.load_solution(data_root() / CLUSTERS["cluster24"][2])}
    if "methods" in report:
        m = report["methods"]["cluster24"]
        placements["ours (throughput)"] = {int(k): tuple(v) for k, v in m["throughput_plan"].items()}
        placements["ours (max-flow)"] = {int(k): tuple(v) for k, v in m["max_flow_plan"].items()}
    sim = bench_simulator(placements, 120.0 if quick else 600.0)
    print_table("simulated decode throughput, cluster24 70B offline IWRR",
                [{"placement": k, **v} for k, v in sim.items()],
                ["placement", "decode_tokens_per_s", "ratio_to_helix", "decode_latency_s", "avg_route_depth"])
    return sim


if __name__ == "__main__":
    sys.exit(main())
