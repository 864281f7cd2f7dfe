"""What limits a placement in the simulator: the ``bottleneck`` section of ``benchmarks/planner.py``.

The target is >= 1.3x the authors' Helix placement on cluster24 (70B, offline, IWRR). Before
pulling a lever, this section measures which resource our placement (and Helix's, in the same
run) is short of, by changing one thing at a time in the simulated system and reading the
decode throughput (sim seeds ``--bottleneck-seeds``, 60 s warm-up + the window):

* ``prefill x0.5`` / ``x0``: every node's prompt latency halved / free (prompt-phase
  interference: a decode batch that shares a layer batch with a prompt pays the prompt's time);
* ``no prefill on <type>``: the same for one GPU type only;
* ``no prefill off the fastest type``: an upper bound for any prefill/decode split that leaves the
  fastest GPUs' own layers as they are (KV transfer free);
* ``feeder cap 0.7`` / ``0.9``: the offline feeder's most-used-layer KV usage (0.8 by default),
  i.e. how throughput follows the number of requests in flight;
* ``token throttling``: gLLM's per-batch prompt/decode budgets (a serving-engine change, not
  Helix's system: reported, not compared);
* ``compute``: mean node utilization, and the least-provisioned layer's KV (tokens).

With ``--bottleneck-climb N`` it also runs the planner's refinement (``placement/refine.py``: 1-2
search moves per candidate, first improvement) from our plan for N checks, each the mean of two
600 s simulations at sim seeds 1 and 2, and simulates the result at sim seed 0 (not used by the
climb): does the simulator know a better placement one or two moves away?
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from p2pserve.helix import format as hf
from p2pserve.helix.root import data_root
from p2pserve.helix.topology import load_helix_topology
from p2pserve.placement.planner import PlannerConfig, plan_for_topology
from p2pserve.placement.refine import refine
from p2pserve.sim.profiles import LayerLatency
from p2pserve.sim.run import SimConfig, simulate
from p2pserve.sim.scenario import Part, Scenario, build_scenario
from p2pserve.sim.workload import OfflineFeeding

CLUSTER = "clusters/single_cluster/cluster24.ini"
HELIX = "layouts/single_cluster/llama70b/ilp/ilp_sol.ini"
MODEL = "llama2-70b"


def _prefill_scaled(sc: Scenario, scale: float, types: set[str] | None, gpu_of) -> Scenario:
    """``sc`` with prompt latency times ``scale`` on nodes of ``types`` (None: every node)."""
    lat = {}
    for i, layer in sc.latencies.items():
        hit = types is None or gpu_of(i) in types
        lat[i] = LayerLatency(tuple(scale * x for x in layer.prompt_s), layer.decode_s, None) if hit else layer
    return replace(sc, latencies=lat)


def _variants(sc: Scenario, gpu_of, gpu_types: list[str]) -> dict[str, tuple[Scenario, SimConfig]]:
    """Name -> (scenario, config changes) of every one-at-a-time change."""
    base = SimConfig(warmup=60.0)
    out = {"as is": (sc, base),
           "prefill x0.5": (_prefill_scaled(sc, 0.5, None, gpu_of), base),
           "prefill x0": (_prefill_scaled(sc, 0.0, None, gpu_of), base)}
    for t in gpu_types:
        out[f"no prefill on {t}"] = (_prefill_scaled(sc, 0.0, {t}, gpu_of), base)
    out[f"no prefill off {gpu_types[0]}"] = (_prefill_scaled(sc, 0.0, set(gpu_types[1:]), gpu_of), base)
    for cap in (0.7, 0.9):
        out[f"feeder cap {cap}"] = (sc, replace(base, feeding=OfflineFeeding(max_usage=cap)))
    out["token throttling"] = (sc, replace(base, throttle="on"))
    return out


def _measure(sc: Scenario, cfg: SimConfig, seeds, duration: float) -> dict:
    runs = [simulate(sc, replace(cfg, seed=s, duration=duration)) for s in seeds]
    return {"decode_tokens_per_s": round(statistics.mean(r.decode_throughput_tokens_per_s for r in runs), 1),
            "decode_latency_s": round(statistics.mean(r.decode_latency_s.mean for r in runs), 3),
            "mean_utilization": round(statistics.mean(statistics.mean(r.node_utilization.values()) for r in runs), 3)}


def bottleneck_section(work: int, duration: float, seeds=(0, 1), climb_checks: int = 0) -> dict:
    """One-at-a-time changes for our plan (planner seed 0) and the authors' Helix placement."""
    data = data_root()
    topo = load_helix_topology(data / CLUSTER, MODEL)
    cluster = hf.load_cluster(data / CLUSTER)
    ours = plan_for_topology(topo, PlannerConfig(work=work, time_limit_s=900.0, seed=0)).assignments
    placements = {"ours": dict(ours), "helix": hf.load_solution(data / HELIX)}
    gpu_types = sorted({n.gpu_type for n in topo.nodes}, key=lambda t: -max(n.throughput[1] for n in topo.nodes
                                                                            if n.gpu_type == t))
    out: dict = {"seeds": list(seeds), "window_s": duration, "work": work}
    for name, p in placements.items():
        sc = build_scenario(MODEL, [Part(cluster, p)])
        rows = {}
        for label, (vsc, cfg) in _variants(sc, lambda i: topo.nodes[i].gpu_type, gpu_types).items():
            rows[label] = _measure(vsc, cfg, seeds, duration)
            print(f"  {name:5s} {label:28s} {rows[label]}", flush=True)
        base = rows["as is"]["decode_tokens_per_s"]
        for r in rows.values():
            r["ratio_to_as_is"] = round(r["decode_tokens_per_s"] / base, 3) if base else None
        out[name] = {"min_layer_kv_tokens": sc.layer_capacity, "rows": rows}
    if climb_checks:
        out["climb"] = _climb(topo, cluster, placements["ours"], climb_checks, duration)
    return out


def _climb(topo, cluster, start, checks: int, duration: float) -> dict:
    """The refinement from our plan on a two-seed check (sim seeds 1, 2); the result at sim seed 0."""
    def at(p, seed):
        sc = build_scenario(MODEL, [Part(cluster, dict(p))])
        return simulate(sc, SimConfig(duration=duration, warmup=60.0, seed=seed)).decode_throughput_tokens_per_s

    def check(p):
        return (at(p, 1) + at(p, 2)) / 2

    best, stats = refine(topo, start, check, checks, seed=0)
    res = {**stats.to_stats(), "start_seed0": round(at(start, 0), 1), "best_seed0": round(at(best, 0), 1),
           "changed": dict(best) != dict(start)}
    print(f"  climb: {res}", flush=True)
    return res


def print_bottleneck(res: dict, print_table) -> None:
    """The section's table: one row per change, ours and Helix's side by side."""
    rows = []
    for label, r in res["ours"]["rows"].items():
        h = res["helix"]["rows"][label]
        rows.append({"change": label, "ours": r["decode_tokens_per_s"], "ours_ratio": r["ratio_to_as_is"],
                     "ours_latency_s": r["decode_latency_s"], "ours_util": r["mean_utilization"],
                     "helix": h["decode_tokens_per_s"], "helix_ratio": h["ratio_to_as_is"],
                     "ours_over_helix": round(r["decode_tokens_per_s"] / h["decode_tokens_per_s"], 3)})
    print_table(f"what limits cluster24 (70B offline IWRR; min-layer KV ours {res['ours']['min_layer_kv_tokens']:.0f}, "
                f"Helix {res['helix']['min_layer_kv_tokens']:.0f} tokens)", rows, list(rows[0]))
