"""Prefill/decode split against one shared placement (phase awareness), simulated.

Run from the repository root::

    python benchmarks/phase_split.py --json benchmarks/results/phase_split.json

For each of the Helix §5.1 clusters (``cluster24``, ``cluster24_geo``, ``cluster42``), LLaMA-2-70B,
offline, IWRR:

* whether a full split fits at all: each side must hold the whole model, so the nodes' largest
  ranges must add up to two copies (``full_split_fits``);
* where it fits, the split found by ``sim/split_search.py`` (prefill nodes by GPU type: a
  hill-climb scored by ``--check-window`` s simulations at simulator seed 1, started from the
  nodes with the largest prefill-over-decode speed that hold one copy, ``advantage_start``), then
  simulated at seed 0 over 60 s + ``--window`` s;
* in the same run, the non-split baselines on both of the simulator's engines (Helix's caps with
  atomic prompts, and p2pserve's chunked prefill): the Helix-objective plan (our planner, max-flow
  objective, the stand-in where the authors' placement is not in their data) and Petals.

The split's prefill side runs whole prompts (chunking splits the very work that side is for) and
its decode side never sees one, so one split figure is compared with each engine's baselines.
Ratios: split over the best non-split placement of each engine, and over the Helix stand-in.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pserve.helix import format as hf  # noqa: E402
from p2pserve.helix.root import data_root  # noqa: E402
from p2pserve.helix.topology import load_helix_topology  # noqa: E402
from p2pserve.placement.heuristics import petals_greedy  # noqa: E402
from p2pserve.placement.planner import PlannerConfig, plan_for_topology  # noqa: E402
from p2pserve.sim.disagg import simulated_split  # noqa: E402
from p2pserve.sim.plan_check import simulated_decode  # noqa: E402
from p2pserve.sim.split_search import advantage_start, full_split_fits, search_split  # noqa: E402

MODEL = "llama2-70b"
CLUSTERS = {
    "cluster24": "clusters/single_cluster/cluster24.ini",
    "cluster24_geo": "clusters/distributed/cluster24_geo.ini",
    "cluster42": "clusters/heterogeneity/cluster42.ini",
}


def run_cluster(name: str, args) -> dict:
    path = data_root() / CLUSTERS[name]
    topo, cluster = load_helix_topology(path, MODEL), hf.load_cluster(path)
    slots = sum(n.max_layers for n in topo.nodes)
    out: dict = {"layer_slots": slots, "needed": 2 * topo.num_layers, "fits": full_split_fits(topo)}
    if not out["fits"]:
        print(f"{name}: a full split does not fit ({slots} layer slots < {2 * topo.num_layers})", flush=True)
        return out
    t0 = time.monotonic()

    def check(split) -> float:
        return simulated_split(cluster, MODEL, split, duration=args.check_window, seed=1).decode_throughput_tokens_per_s

    found = search_split(topo, advantage_start(topo), check, max_candidates=args.candidates, work=args.work)
    out["search_s"] = round(time.monotonic() - t0, 1)
    out["prefill_counts"] = found.counts
    out["tried"] = [[c, round(s, 1)] for c, s in found.tried]
    res = simulated_split(cluster, MODEL, found.placement, duration=args.window, seed=0)
    out["split"] = round(res.decode_throughput_tokens_per_s, 1)
    out["split_prompt_latency_s"] = round(res.prompt_latency_s.mean, 1)
    out["split_decode_latency_s"] = round(res.decode_latency_s.mean, 3)
    out["split_kv_transfer_s_mean"] = res.extra["kv_transfer_s_mean"]
    out["prefill"] = sorted([i, *r] for i, r in found.placement.prefill.items())
    out["decode"] = sorted([i, *r] for i, r in found.placement.decode.items())
    helix = plan_for_topology(topo, PlannerConfig(objective="max-flow", work=args.work, seed=0)).assignments
    for engine, throttle in (("caps", False), ("chunked", "chunked")):
        base = {b: round(simulated_decode(cluster, MODEL, p, duration=args.window, seed=0, throttle=throttle), 1)
                for b, p in (("helix_objective", helix), ("petals", petals_greedy(topo)))}
        out[engine] = dict(base, split_over_best=round(out["split"] / max(base.values()), 3),
                           split_over_helix_objective=round(out["split"] / base["helix_objective"], 3))
    print(f"{name}: split {out['split']} tok/s (prefill {found.counts}); caps {out['caps']}; "
          f"chunked {out['chunked']}; search {out['search_s']} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clusters", nargs="+", default=list(CLUSTERS), choices=list(CLUSTERS))
    ap.add_argument("--window", type=float, default=600.0, help="reported simulations: seconds after a 60 s warm-up")
    ap.add_argument("--check-window", type=float, default=600.0, help="the search's simulations (seed 1)")
    ap.add_argument("--candidates", type=int, default=40, help="most splits the search scores")
    ap.add_argument("--work", type=int, default=2000, help="planner evaluations per side (PlannerConfig.work)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    result = {"model": MODEL, "load_average": os.getloadavg()[0],
              "clusters": {name: run_cluster(name, args) for name in args.clusters}}
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
