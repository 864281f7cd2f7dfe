"""The coordinator's solve (``plan_at_scale``) on the Helix authors' clusters, against the planner
it wraps (``plan_for_topology``) in the same run.

cluster24 and cluster10 (the single-cluster and ablation settings), cluster24_geo and cluster42
(the geo-distributed and high-heterogeneity ones): each objective (throughput, the default, and
max-flow, Helix's) at a work budget, so both runs are reproducible. Printed per cluster and
objective: max-flow, estimated decode tokens/s, with ``--sim`` the simulated decode of the
throughput plan (offline, IWRR, 60 s + ``--window`` s, sim seed 0: the setting of
``planner_repro.versus_helix_section``), whether the two placements are the same, and the ratio
``plan_at_scale`` / ``plan_for_topology``. Up to ``ScaleConfig.direct_nodes`` nodes they must be
the same placement. ``python benchmarks/scale_helix.py --sim --json benchmarks/results/scale_helix.json``
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from planner_repro import REPRO_CLUSTERS, _digest, _simulated  # benchmarks/ is on sys.path as a script

from p2pserve.helix import format as hf
from p2pserve.helix.root import data_root
from p2pserve.helix.topology import load_helix_topology
from p2pserve.placement.planner import PlannerConfig, plan_for_topology
from p2pserve.placement.scale import plan_at_scale


def _row(sol, t: float) -> dict:
    return {"digest": _digest(sol.assignments), "max_flow": round(sol.max_flow, 2),
            "est_decode": round(sol.estimate.decode_tokens_per_s, 1), "solve_s": round(t, 2)}


def main() -> None:
    """Both solves per cluster and objective; print, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sim", action="store_true", help="also simulate the throughput plans")
    ap.add_argument("--window", type=float, default=600.0)
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/scale_helix.json"))
    args = ap.parse_args()
    out: dict = {}
    for cname, (path, model, _) in REPRO_CLUSTERS.items():
        topo = load_helix_topology(data_root() / path, model)
        cluster = hf.load_cluster(data_root() / path)
        for objective in ("throughput", "max-flow"):
            cfg = PlannerConfig(objective=objective, work=args.work, seed=args.seed, time_limit_s=600.0)
            rows = {}
            for name, solve in (("today", plan_for_topology), ("at_scale", plan_at_scale)):
                t = time.perf_counter()
                sol = solve(topo, cfg)
                rows[name] = _row(sol, time.perf_counter() - t)
                if args.sim and objective == "throughput":
                    rows[name]["sim_decode"] = round(_simulated(cluster, model, sol.assignments, args.window), 1)
            a, b = rows["at_scale"], rows["today"]
            key = "sim_decode" if "sim_decode" in a else "est_decode" if objective == "throughput" else "max_flow"
            rows["same_placement"] = a["digest"] == b["digest"]
            rows["ratio"] = a[key] / b[key] if b[key] else None
            out[f"{cname}/{objective}"] = rows
            print(f"{cname}, {objective}: plan_at_scale max-flow {a['max_flow']}, est. decode {a['est_decode']}"
                  + (f", simulated {a['sim_decode']}" if "sim_decode" in a else "")
                  + f"; {rows['ratio']:.2f}x plan_for_topology on {key} (same placement: {rows['same_placement']})",
                  flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
