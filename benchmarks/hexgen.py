"""HexGen (ICML'24) benchmark: planner-chosen GPU grouping against symmetric baselines.

Run from the repository root::

    python benchmarks/hexgen.py --json benchmarks/results/hexgen.json
    python benchmarks/hexgen.py --quick          # shorter simulator windows and searches

Everything is simulated (``p2pserve/sim`` with TP-group nodes, :mod:`p2pserve.sim.tp_groups`)
on LLaMA-2-70B with the HexGen cost model (:mod:`p2pserve.placement.tp_cost`). Sections:

* ``fit`` -- the cost model's link constants fitted to Helix's measured TP profiles
  (T4 -> T4x2/T4x4, L4 -> L4x2) and the fit's mean relative error.
* ``case_study`` -- HexGen §3.1 (4x A6000, 2x A5000, 2x A4000): the paper's three layouts under
  its workload (one request at a time, 128 prompt / 64 output tokens), decode tokens/s and
  ratios; swept over the unknown inter-box latency (the paper gives none; §5.1's intra-region
  figure, 2 ms at 5 Gbit/s, is the default).
* ``methods`` -- on the case study and on §5.1's heterogeneous-full-price cluster (58 GPUs):
  planner-chosen grouping (:func:`~p2pserve.placement.grouping.plan_grouping`, each candidate
  grouping scored by a short simulation, ``planner``; and by the planner's estimate alone,
  ``planner_estimate``; either search's result then challenged by every symmetric layout under
  the same score, :func:`~p2pserve.placement.symmetric.challenge_with_symmetric`) against TP = 1
  everywhere and against the best single TP degree for every machine (each degree planned with
  the same planner budget, the best by simulated throughput), and against HexGen's own "w/o
  asymmetric" ablation (one degree, pipelines of equal stages, :mod:`p2pserve.placement.symmetric`;
  the best feasible layout), offline (Helix's rule, Azure
  conversation lengths, IWRR) in steady state: ``--warmup`` 600 s, then a ``--window`` of 600 s
  (offline feeding fills every KV cache at the start, and a TP-8 group of 48 GB GPUs needs
  minutes to prefill what it admitted). Ratios are against baselines simulated in the same run;
  the planner's solve time (wall and CPU) is reported with the machine's load average.
* ``slo`` -- the same comparison under HexGen's own metric (§5, :mod:`p2pserve.sim.slo`): the
  peak Poisson request rate at which >= ``--slo-goal`` of requests finish within ``--slo-scale``
  x their latency alone on one A100, and the decode tokens/s there. The grouping search is
  scored by that rate (``slo_score``), then challenged by the symmetric layouts under it; every
  method is reported on the ``--slo-seeds`` held-out simulator seeds (six by default: a 120 s
  window's peak rate varies by up to 40 % from seed to seed).
* ``slo_long`` -- the SLO section's planner and symmetric layouts, as it placed them, re-measured
  with ``--slo-long-window`` (600 s) windows on the same seeds; with ``--skip slo`` it reads that
  section from ``--json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2pserve.helix.format import load_profile  # noqa: E402
from p2pserve.helix.hexgen_clusters import LAN, case_study, case_study_layouts, full_price  # noqa: E402
from p2pserve.placement.grouping import (  # noqa: E402
    GroupingConfig,
    estimate_score,
    groups_of,
    plan_choice,
    plan_grouping,
    uniform_choices,
)
from p2pserve.placement.machines import NetLink, group_topology  # noqa: E402
from p2pserve.placement.symmetric import challenge_with_symmetric, symmetric_layouts  # noqa: E402
from p2pserve.placement.tp_cost import fit_link  # noqa: E402
from p2pserve.sim.run import SimConfig, simulate  # noqa: E402
from p2pserve.sim.slo import SloSearch, SloSpec, peak_rate  # noqa: E402
from p2pserve.sim.tp_groups import fixed_lengths_file, group_scenario, sim_score, slo_score  # noqa: E402
from p2pserve.sim.workload import OfflineFeeding  # noqa: E402

MODEL = "llama2-70b"


def load() -> list[float]:
    """The 1/5/15-minute load averages (the machine is shared; figures depend on it)."""
    return [round(x, 2) for x in os.getloadavg()]


def fit_section() -> dict:
    """Fit (alpha, beta) to Helix's TP profiles; report the constants and the error."""
    out = {}
    for single, grouped in (("t4", [(2, "t4x2"), (4, "t4x4")]), ("l4", [(2, "l4x2")])):
        link, err = fit_link(load_profile(MODEL, single), [(d, load_profile(MODEL, g)) for d, g in grouped], 16384)
        out[single] = {"groups": [g for _, g in grouped], "bus_GB_per_s": link.bus_bytes_per_s / 1e9,
                       "alpha_us": link.latency_s * 1e6, "mean_rel_error": err}
    return out


def single_request(topo, placement, lengths: str, duration: float) -> float:
    """Decode tokens/s of one 128/64 request at a time (HexGen §3.1's measurement)."""
    cfg = SimConfig(mode="offline", duration=duration, warmup=10.0, lengths=lengths,
                    feeding=OfflineFeeding(initial=1, max_usage=0.0))
    return simulate(group_scenario(topo, placement), cfg).decode_throughput_tokens_per_s


def offline(topo, placement, window: tuple[float, float], seed: int) -> float:
    """Decode tokens/s under Helix's offline rule (Azure conversation lengths, IWRR); the same
    ``(warm-up, duration)`` as the search's score (``sim_score``), on the given seed."""
    cfg = SimConfig(mode="offline", duration=window[1], warmup=window[0], seed=seed)
    return simulate(group_scenario(topo, placement), cfg).decode_throughput_tokens_per_s


def case_study_section(lengths: str, latencies_ms: list[float], duration: float) -> dict:
    """The §3.1 layouts under one-request-at-a-time load, per inter-box latency."""
    rows = []
    for ms in latencies_ms:
        cluster = case_study(NetLink(LAN.bytes_per_s, ms / 1000.0))
        tps = {}
        for name, (groups, placement) in case_study_layouts().items():
            tps[name] = single_request(group_topology(cluster, groups), placement, lengths, duration)
        rows.append({"inter_box_latency_ms": ms, "decode_tokens_per_s": tps,  # one request at a time
                     "hexgen_over_pp8": tps["hexgen"] / tps["pp8"],
                     "hexgen_over_pp2_tp4": tps["hexgen"] / tps["pp2_tp4"]})
    return {"paper": {"hexgen_over_best_symmetric": 2.0, "hexgen_over_worst_symmetric": 19.0}, "rows": rows}


def _timed_grouping(cluster, cfg: GroupingConfig, score) -> tuple:
    """The grouping search, then the symmetric layouts as challengers under the same score (one
    score object: ``slo_score`` probes each challenger at the search's best rate first), timed."""
    t0, c0 = time.perf_counter(), time.process_time()
    load_before = load()
    score = score or estimate_score
    chosen = challenge_with_symmetric(cluster, plan_grouping(cluster, cfg, score=score), cfg, score)
    solve = {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
             "candidates": len(chosen.tried), "load_avg": [load_before, load()]}
    return chosen, solve


def symmetric_row(cluster, cfg: GroupingConfig, window: tuple[float, float], seeds: list[int], tried: dict) -> dict:
    """HexGen's "w/o asymmetric" baseline (``placement/symmetric.py``: one degree, equal stages,
    pipelines inside a region): the best feasible layout on the search seed, reported on the
    held-out ``seeds``. ``tried``: the sim-scored search's record, where the symmetric challenge
    already simulated every layout on the search seed with this window."""
    scored = [(tried[lay.label], lay) for lay in symmetric_layouts(cluster, cfg)]
    score, best = max(scored, key=lambda x: x[0])
    return {**_sim_row(best.choice, best.topology, best.placement, window, seeds), "degree": best.degree,
            "stages": best.stages, "pipelines": best.pipelines, "search_score": score,
            "tried": {f"tp{lay.degree} x {lay.stages} stages": v for v, lay in scored}}


def methods_section(cluster, cfg: GroupingConfig, window: tuple[float, float], seeds: list[int],
                    lengths: str | None) -> dict:
    """Planner-chosen grouping (scored by the simulator on seed ``cfg.seed``, and by the
    planner's estimate alone) vs TP=1 everywhere vs the best fixed TP degree; every placement
    by the same planner on the same budget; reported on held-out simulator ``seeds``."""
    chosen, solve = _timed_grouping(cluster, cfg, sim_score(window[1], cfg.seed, warmup=window[0]))
    by_est, solve_est = _timed_grouping(cluster, cfg, None)
    rows = {"planner": _row(chosen.choice, chosen.topology, chosen.solution, window, seeds, lengths),
            "planner_estimate": _row(by_est.choice, by_est.topology, by_est.solution, window, seeds, lengths)}
    for key, res in (("planner", chosen), ("planner_estimate", by_est)):
        rows[key].update(search_score=res.score, method=res.solution.method)
    for d, choice in uniform_choices(cluster, cfg).items():
        try:
            _, topo, sol = plan_choice(cluster, choice, cfg, cfg.eval_work)
        except Exception as exc:  # a degree whose groups cannot hold a copy of the model
            rows[f"tp{d}"] = {"choice": [list(g) for g in choice], "error": str(exc)}
            continue
        rows[f"tp{d}"] = _row(choice, topo, sol, window, seeds, lengths)
    fixed = {k: v for k, v in rows.items() if k.startswith("tp") and "sim_decode_tokens_per_s" in v}
    best = max(fixed, key=lambda k: fixed[k]["sim_decode_tokens_per_s"])
    rows["symmetric"] = symmetric_row(cluster, cfg, window, seeds, chosen.tried)
    p = rows["planner"]["sim_decode_tokens_per_s"]
    out = {"cluster": cluster.name, "gpus": cluster.num_gpus, "machines": len(cluster.machines), "solve": solve,
           "solve_estimate": solve_est,
           "planner_estimate_over_best_fixed": rows["planner_estimate"]["sim_decode_tokens_per_s"]
           / fixed[best]["sim_decode_tokens_per_s"],
           "rows": rows, "best_fixed": best,
           "planner_over_tp1": p / rows["tp1"]["sim_decode_tokens_per_s"] if "tp1" in fixed else None,
           "planner_over_best_fixed": p / fixed[best]["sim_decode_tokens_per_s"],
           "planner_over_symmetric": p / rows["symmetric"]["sim_decode_tokens_per_s"]}
    if lengths is not None:
        sr = {k: v["single_request_tokens_per_s"] for k, v in rows.items() if "single_request_tokens_per_s" in v}
        out["single_request_planner_over_best_fixed"] = sr["planner"] / max(v for k, v in sr.items() if k.startswith("tp"))
    return out


def slo_section(cluster, cfg: GroupingConfig, spec: SloSpec, search: SloSearch, seeds: list[int]) -> dict:
    """Peak request rate within the SLO: the SLO-scored planner (search on ``search.seed``, then
    the symmetric challengers) against TP = 1, every fixed degree and the best symmetric layout,
    each reported as the mean over held-out ``seeds``."""
    chosen, solve = _timed_grouping(cluster, cfg, slo_score(spec, search))
    placed = {"planner": (chosen.choice, chosen.topology, chosen.solution.assignments)}
    for d, choice in uniform_choices(cluster, cfg).items():
        try:
            _, topo, sol = plan_choice(cluster, choice, cfg, cfg.eval_work)
        except Exception:  # a degree whose groups cannot hold a copy of the model
            continue
        placed[f"tp{d}"] = (choice, topo, sol.assignments)
    # HexGen's "w/o asymmetric" ablation: the symmetric layout with the highest peak rate on the search seed
    sym = max(symmetric_layouts(cluster, cfg),
              key=lambda lay: peak_rate(group_scenario(lay.topology, lay.placement), spec, search).rate_qps)
    placed["symmetric"] = (sym.choice, sym.topology, sym.placement)
    rows = {}
    for name, (choice, topo, assignments) in placed.items():
        scenario = group_scenario(topo, assignments)
        points = [peak_rate(scenario, spec, dataclasses.replace(search, seed=s)) for s in seeds]
        rows[name] = {"choice": [list(g) for g in choice], "nodes": topo.num_nodes,
                      "placement": {str(i): list(r) for i, r in sorted(assignments.items())},
                      "peak_rate_qps_by_seed": [p.rate_qps for p in points],
                      "peak_rate_qps": sum(p.rate_qps for p in points) / len(points),
                      "slo_decode_tokens_per_s": sum(p.decode_tokens_per_s for p in points) / len(points)}
    rows["symmetric"].update(degree=sym.degree, stages=sym.stages, pipelines=sym.pipelines)
    rows["planner"].update(search_score=chosen.score, method=chosen.solution.method)
    fixed = {k: v for k, v in rows.items() if k.startswith("tp")}
    best = max(fixed, key=lambda k: fixed[k]["peak_rate_qps"])
    p = rows["planner"]["peak_rate_qps"]
    sym_rate = rows["symmetric"]["peak_rate_qps"]
    return {"cluster": cluster.name, "solve": solve, "rows": rows, "best_fixed": best,
            "planner_over_symmetric": p / sym_rate if sym_rate else None,
            "planner_over_tp1": p / rows["tp1"]["peak_rate_qps"] if rows.get("tp1", {}).get("peak_rate_qps") else None,
            "planner_over_best_fixed": p / fixed[best]["peak_rate_qps"] if fixed[best]["peak_rate_qps"] else None}


def slo_long_section(slo: dict, spec: SloSpec, search: SloSearch, seeds: list[int]) -> dict:
    """The SLO section's planner and symmetric layouts re-measured with longer windows
    (``search.duration``) on the same held-out ``seeds``: each layout as that section placed it
    (its grouping and node -> layer range), so this tells noise from a real difference."""
    out = {}
    for name, cluster in (("case_study", case_study()), ("full_price", full_price())):
        rows = {}
        for key in ("planner", "symmetric"):
            row = slo[name]["rows"][key]
            topo = group_topology(cluster, groups_of(cluster, [tuple(g) for g in row["choice"]]))
            placement = {int(i): tuple(r) for i, r in row["placement"].items()}
            points = [peak_rate(group_scenario(topo, placement), spec, dataclasses.replace(search, seed=s))
                      for s in seeds]
            rows[key] = {"peak_rate_qps_by_seed": [p.rate_qps for p in points],
                         "peak_rate_qps": sum(p.rate_qps for p in points) / len(points)}
        sym = rows["symmetric"]["peak_rate_qps"]
        out[name] = {"rows": rows, "planner_over_symmetric": rows["planner"]["peak_rate_qps"] / sym if sym else None}
    return out


def _sim_row(choice, topo, placement, window: tuple[float, float], seeds: list[int]) -> dict:
    """A layout's grouping, placement and offline decode tokens/s on each held-out seed and their mean."""
    per_seed = [offline(topo, placement, window, s) for s in seeds]
    return {"choice": [list(g) for g in choice], "nodes": topo.num_nodes,
            "placement": {topo.nodes[i].name: list(r) for i, r in placement.items()},
            "sim_decode_tokens_per_s_by_seed": dict(zip(map(str, seeds), per_seed)),
            "sim_decode_tokens_per_s": sum(per_seed) / len(per_seed)}


def _row(choice, topo, sol, window: tuple[float, float], seeds: list[int], lengths: str | None) -> dict:
    row = {**_sim_row(choice, topo, sol.assignments, window, seeds),
           "estimate_decode_tokens_per_s": sol.estimate.decode_tokens_per_s, "max_flow": sol.max_flow}
    if lengths is not None:
        row["single_request_tokens_per_s"] = single_request(topo, sol.assignments, lengths, window[1])
    return row


def main(argv: list[str] | None = None) -> int:
    """Run the sections, print a summary, write ``--json``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short simulator windows, smaller searches")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    ap.add_argument("--seed", type=int, default=0, help="planner and search-score simulator seed")
    ap.add_argument("--eval-seeds", type=int, nargs="+", default=[1, 2],
                    help="held-out simulator seeds the methods are reported on")
    ap.add_argument("--slo-seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6],
                    help="held-out simulator seeds the SLO section is reported on (a 120 s window's peak rate "
                         "moves by up to 40%% from seed to seed, so it takes more seeds than the methods)")
    ap.add_argument("--latencies-ms", type=float, nargs="+", default=[2.0, 5.0, 8.0, 10.0],
                    help="case study: inter-box one-way latencies to sweep")
    ap.add_argument("--slo-scale", type=float, default=5.0,
                    help="SLO: multiple of a request's latency alone on one A100 (HexGen §5)")
    ap.add_argument("--slo-goal", type=float, default=0.95, help="SLO attainment the peak rate must keep")
    ap.add_argument("--slo-long-window", type=float, default=None,
                    help="slo_long: the window the SLO section's planner and symmetric layouts are re-measured "
                         "at (default 600 s, --quick 120 s)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["case_study", "methods", "slo", "slo_long"],
                    help="sections not to run")
    ap.add_argument("--warmup", type=float, default=None,
                    help="methods: simulated warm-up before the window (default 600 s, --quick 12 s)")
    ap.add_argument("--window", type=float, default=None,
                    help="methods: simulated seconds measured (default 600 s, --quick 60 s)")
    args = ap.parse_args(argv)
    duration = 60.0 if args.quick else 120.0  # the SLO section's window (online arrivals: no start-up flood)
    # Offline feeding fills every KV cache at start; large TP groups take minutes to prefill it,
    # so the methods compare groupings in steady state (sim_score's docstring, docs/hexgen.md).
    window = (args.warmup if args.warmup is not None else (12.0 if args.quick else 600.0),
              args.window if args.window is not None else (60.0 if args.quick else 600.0))
    cfg = GroupingConfig(eval_work=100 if args.quick else 300, max_candidates=20 if args.quick else 60,
                         seed=args.seed)
    lengths = fixed_lengths_file(128, 64)
    try:
        res = {"load_avg_start": load(), "config": {"duration_s": duration, "methods_warmup_s": window[0],
                                                      "methods_window_s": window[1], "eval_work": cfg.eval_work,
                                                      "max_candidates": cfg.max_candidates, "seed": args.seed,
                                                      "eval_seeds": args.eval_seeds}}
        res["fit"] = fit_section()
        if "case_study" not in args.skip:
            res["case_study"] = case_study_section(lengths, args.latencies_ms, 1200.0)
        if "methods" not in args.skip:
            res["methods"] = {
                "case_study": methods_section(case_study(), cfg, window, args.eval_seeds, lengths),
                "full_price": methods_section(full_price(), cfg, window, args.eval_seeds, None),
            }
        spec = SloSpec(load_profile(MODEL, "a100"), 80, scale=args.slo_scale, goal=args.slo_goal)
        if "slo" not in args.skip:
            search = SloSearch(duration=duration, seed=args.seed)
            res["config"]["slo"] = {"scale": spec.scale, "goal": spec.goal, "reference": "a100",
                                    "window_s": search.duration, "drain_s": search.drain, "steps": search.steps,
                                    "eval_seeds": args.slo_seeds}
            res["slo"] = {"case_study": slo_section(case_study(), cfg, spec, search, args.slo_seeds),
                          "full_price": slo_section(full_price(), cfg, spec, search, args.slo_seeds)}
        if "slo_long" not in args.skip:  # this run's SLO section, else the one in --json
            slo = res.get("slo") or (json.loads(Path(args.json).read_text())["slo"] if args.json else None)
            if slo is None:
                ap.error("slo_long re-measures the SLO section's layouts: run it too, or give --json with them")
            long = SloSearch(duration=args.slo_long_window or (120.0 if args.quick else 600.0), seed=args.seed)
            res["config"]["slo_long"] = {"window_s": long.duration, "eval_seeds": args.slo_seeds}
            res["slo_long"] = slo_long_section(slo, spec, long, args.slo_seeds)
        res["load_avg_end"] = load()
    finally:
        os.unlink(lengths)
    _print(res)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Keep the sections this run skipped: a partial run updates the file, it does not shrink it.
        old = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**old, **res}, indent=1))
    return 0


def _print(res: dict) -> None:
    for gpu, f in res["fit"].items():
        print(f"fit {gpu}: beta {f['bus_GB_per_s']:.2f} GB/s alpha {f['alpha_us']:.0f} us "
              f"mean rel err {100 * f['mean_rel_error']:.1f}%")
    for r in res.get("case_study", {}).get("rows", []):
        t = r["decode_tokens_per_s"]
        print(f"case study @{r['inter_box_latency_ms']:g} ms: hexgen {t['hexgen']:.2f} pp8 {t['pp8']:.2f} "
              f"pp2_tp4 {t['pp2_tp4']:.2f} tok/s; hexgen/pp8 {r['hexgen_over_pp8']:.2f}x "
              f"hexgen/pp2_tp4 {r['hexgen_over_pp2_tp4']:.1f}x")
    for name, m in res.get("slo", {}).items():
        print(f"SLO {name}: planner {m['rows']['planner']['choice']} ({m['rows']['planner']['method']}) "
              f"solve {m['solve']['wall_s']:.1f} s")
        for k, v in m["rows"].items():
            print(f"  {k:8s} peak {v['peak_rate_qps']:6.2f} req/s  {v['slo_decode_tokens_per_s']:8.1f} decode tok/s")
        o1, ob = m["planner_over_tp1"], m["planner_over_best_fixed"]
        os_ = m.get("planner_over_symmetric")
        print(f"  planner / tp1 {'-' if o1 is None else f'{o1:.2f}x'}, / best fixed ({m['best_fixed']}) "
              f"{'-' if ob is None else f'{ob:.2f}x'}, / symmetric {'-' if os_ is None else f'{os_:.2f}x'}")
    for name, m in res.get("slo_long", {}).items():
        r, o = m["rows"], m["planner_over_symmetric"]
        print(f"SLO {name}, {res['config']['slo_long']['window_s']:g} s windows: planner "
              f"{r['planner']['peak_rate_qps']:.2f} req/s, symmetric {r['symmetric']['peak_rate_qps']:.2f}; "
              f"planner / symmetric {'-' if o is None else f'{o:.2f}x'}")
    for name, m in res.get("methods", {}).items():
        print(f"{name}: planner {m['rows']['planner']['choice']} ({m['rows']['planner']['method']}) "
              f"solve {m['solve']['wall_s']:.1f} s "
              f"(load {m['solve']['load_avg'][0][0]})")
        for k, v in m["rows"].items():
            if "sim_decode_tokens_per_s" in v:
                print(f"  {k:8s} sim {v['sim_decode_tokens_per_s']:8.1f} "
                      f"est {v.get('estimate_decode_tokens_per_s', float('nan')):8.1f} nodes {v['nodes']}")
        print(f"  planner / tp1 {m['planner_over_tp1']:.2f}x, / best fixed ({m['best_fixed']}) "
              f"{m['planner_over_best_fixed']:.2f}x; estimate-scored planner / best fixed "
              f"{m['planner_estimate_over_best_fixed']:.2f}x; planner / symmetric (tp{m['rows']['symmetric']['degree']} "
              f"x {m['rows']['symmetric']['stages']} stages) {m['planner_over_symmetric']:.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
