"""The ``estimate_check`` section of ``benchmarks/planner.py``: the decode estimate against the
simulator on held-back placements.

The requirement: "the planner's decode estimate is checked against the simulator on held-back
placements, and its error is reported". The estimate's constants were fitted on cluster24
placements; here every cluster of ``planner_repro.VERSUS_CLUSTERS`` gets placements the fit never
saw (``placement.calibration.held_back_placements``: heuristics, chains, tiered starts, our plans
at planner seeds other than 0, the Helix-objective plan, random perturbations of the plans),
simulated at a simulator seed (1) other than the fit's (0). Per cluster: mean and max |error|,
bias, Spearman, the worst placement.
"""

from __future__ import annotations

from dataclasses import asdict

from p2pserve.helix import format as hf
from p2pserve.helix.root import data_root
from p2pserve.helix.topology import load_helix_topology
from p2pserve.placement.calibration import error_report, held_back_placements
from p2pserve.placement.estimate import estimate
from p2pserve.placement.planner import PlannerConfig, plan_for_topology
from p2pserve.sim.plan_check import simulated_decode
from planner_repro import REPRO_CLUSTERS, VERSUS_CLUSTERS  # this directory is on sys.path


def estimate_check_section(planner_seeds: list[int], work: int, duration: float, per_plan: int = 3,
                           sim_seed: int = 1, clusters=VERSUS_CLUSTERS, time_limit_s: float = 900.0) -> dict:
    """Estimate vs simulation per cluster; returns ``{cluster: {"report": ..., "rows": [...]}}``."""
    data = data_root()
    out = {}
    for cname in clusters:
        path, model, _ = REPRO_CLUSTERS[cname]
        topo = load_helix_topology(data / path, model)
        cluster = hf.load_cluster(data / path)
        plans = {}
        for seed in planner_seeds:
            cfg = PlannerConfig(work=work, time_limit_s=time_limit_s, seed=seed)
            plans[f"ours-s{seed}"] = plan_for_topology(topo, cfg).assignments
        mf = PlannerConfig(objective="max-flow", work=work, time_limit_s=time_limit_s, seed=planner_seeds[0])
        plans["maxflow"] = plan_for_topology(topo, mf).assignments
        rows = []
        for name, p in held_back_placements(topo, plans, per_plan=per_plan, seed=sim_seed).items():
            est = estimate(topo, p).decode_tokens_per_s
            sim = simulated_decode(cluster, model, p, duration=duration, seed=sim_seed)
            rows.append((name, est, sim))
        rep = error_report(rows)
        out[cname] = {"report": asdict(rep), "duration_s": duration, "sim_seed": sim_seed,
                      "rows": [{"placement": n, "estimate": round(e, 1), "simulated": round(s, 1),
                                "error": round(e / s - 1.0, 3) if s > 0 else None} for n, e, s in rows]}
        print(f"  {cname}: n={rep.n} mean |err| {rep.mean_abs_rel:.3f}, max {rep.max_abs_rel:.3f} ({rep.worst}), "
              f"bias {rep.bias:+.3f}, spearman {rep.spearman:.3f}", flush=True)
    return out


def print_estimate_check(res: dict, print_table) -> None:
    """One summary row per cluster."""
    rows = [{"cluster": k, **{c: (round(v["report"][c], 3) if isinstance(v["report"][c], float) else v["report"][c])
                              for c in ("n", "mean_abs_rel", "max_abs_rel", "bias", "spearman", "worst")}}
            for k, v in res.items()]
    print_table("decode estimate vs simulator on held-back placements", rows, list(rows[0]))
