"""``p2pserve plan``: solve a layer placement for a Helix cluster file and print it.

Example::

    p2pserve plan --cluster single_cluster/cluster24.ini --model llama2-70b --time-limit 60 \\
        --objective max-flow --json

A relative ``--cluster`` that does not exist as given is looked up under the Helix data root's
``clusters/`` (``--data``, else ``$P2PSERVE_HELIX_DATA``, else the copy shipped with the package;
see :mod:`p2pserve.helix.root`).
"""

from __future__ import annotations

import argparse
import sys

from p2pserve.cli.machine_output import print_json, stdout_to_stderr
from p2pserve.errors import P2PServeError
from p2pserve.helix.root import data_root, resolve_file
from p2pserve.helix.topology import load_helix_topology
from p2pserve.placement.planner import OBJECTIVES, PlannerConfig, plan_for_topology
from p2pserve.placement.solution import Solution
from p2pserve.placement.topology import BandwidthConvention, Topology


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``plan`` flags."""
    parser.add_argument("--cluster", required=True,
                        help="Helix cluster .ini file, or a name under the data root's clusters/")
    parser.add_argument("--data", default=None, metavar="DIR",
                        help="Helix data root (default: $P2PSERVE_HELIX_DATA, else the packaged copy)")
    parser.add_argument("--model", required=True, choices=["llama2-70b", "llama1-30b"])
    parser.add_argument("--time-limit", type=float, default=60.0,
                        help="wall-clock seconds (default 60; an outer safety limit when --work is given)")
    parser.add_argument("--work", type=int, default=None, metavar="EVALS",
                        help="search budget in evaluations: the same inputs and --seed give the same "
                             "placement on any machine, however loaded")
    parser.add_argument("--objective", choices=OBJECTIVES, default="throughput",
                        help="throughput: depth/KV-aware decode estimate (default); max-flow: Helix's")
    parser.add_argument("--no-partial", action="store_true", help="disallow partial inference")
    parser.add_argument("--no-milp", action="store_true", help="search only (max-flow objective)")
    parser.add_argument("--backend", default="auto", choices=["auto", "highs", "gurobi", "cpsat"])
    parser.add_argument("--max-depth", type=int, default=None, help="reject deeper flow paths")
    parser.add_argument("--max-latency", type=float, default=None, help="per-token latency limit, s")
    parser.add_argument("--bandwidth", choices=[c.value for c in BandwidthConvention],
                        default=BandwidthConvention.HELIX.value,
                        help="how to read the file's bandwidth numbers (default: the authors')")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-window", type=float, default=0.0, metavar="S",
                        help="publish guard: rank the plan, every heuristic baseline and the estimate's best "
                             "tiered candidates by a simulation of S seconds (after a 60 s warm-up) and keep the "
                             "best, so a misleading estimate cannot win (0: off; docs/planner.md)")
    parser.add_argument("--phase-split", action="store_true",
                        help="also search a prefill/decode split (some nodes run prompts only, the rest decode; "
                             "scored by simulations of --check-window seconds, 600 if unset) and report whether "
                             "it simulates faster than the plan; for evaluation: peers cannot serve a split yet "
                             "(docs/planner.md)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--write-solution", default=None, help="also write a Helix *_sol.ini")


def write_solution(path: str, assignments: dict[int, tuple[int, int]]) -> None:
    """Write a Helix-format solution file (compute_node_{i+2} = [layers])."""
    lines = ["[Settings]", "offset=2", "", "[Solution]"]
    for i, (s, e) in sorted(assignments.items()):
        lines.append(f"compute_node_{i + 2}={list(range(s, e))}")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


def run(args: argparse.Namespace) -> int:
    """Solve and print; exit code 0 on success, 2 on a planning/config error.

    With ``--json``, standard output carries the one JSON document and nothing else: whatever the
    solver prints goes to standard error (see :mod:`p2pserve.cli.machine_output`).
    """
    with stdout_to_stderr(args.json) as out:
        return _run(args, out)


def _run(args: argparse.Namespace, out) -> int:
    try:
        root = data_root(args.data)
        cluster = resolve_file(args.cluster, "clusters", root)
        topo = load_helix_topology(cluster, args.model, BandwidthConvention(args.bandwidth), root=root)
        config = PlannerConfig(
            objective=args.objective,
            time_limit_s=args.time_limit,
            partial=not args.no_partial,
            use_milp=not args.no_milp,
            backend=args.backend,
            max_depth=args.max_depth,
            max_latency_s=args.max_latency,
            seed=args.seed,
            work=args.work,
        )
        solution = plan_for_topology(topo, config, check=_check(args, cluster, root))
        split = _phase_split(args, topo, cluster, root, solution) if args.phase_split else None
    except P2PServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.write_solution:
        write_solution(args.write_solution, solution.assignments)
    if args.json:
        print_json(dict(solution.to_json(), **({"phase_split": split} if split is not None else {})), out)
        return 0
    print_solution(topo, args.model, solution)
    if split is not None:
        print_split(split)
    return 0


def _phase_split(args: argparse.Namespace, topo: Topology, cluster, root, plan: Solution) -> dict:
    """Search a prefill/decode split and simulate it against ``plan`` (sim/split_search.py)."""
    from p2pserve.helix import format as hf
    from p2pserve.sim.disagg import simulated_split
    from p2pserve.sim.plan_check import simulated_decode
    from p2pserve.sim.split_search import advantage_start, full_split_fits, layer_slots, search_split

    slots = layer_slots(topo)
    if not full_split_fits(topo):
        return {"fits": False, "layer_slots": slots, "needed": 2 * topo.num_layers}
    window, c = args.check_window or 600.0, hf.load_cluster(cluster)
    found = search_split(topo, advantage_start(topo), work=args.work or 2000, score=lambda sp: simulated_split(
        c, args.model, sp, duration=window, seed=1, root=root).decode_throughput_tokens_per_s)
    shared = simulated_decode(c, args.model, plan.assignments, duration=window, seed=1, root=root)
    sp = found.placement
    return {"fits": True, "layer_slots": slots, "window_s": window, "prefill_counts": found.counts,
            "split_tokens_per_s": round(found.score, 2), "plan_tokens_per_s": round(shared, 2),
            "split_wins": found.score > shared, "candidates": len(found.tried),
            "prefill": {str(i): list(r) for i, r in sorted(sp.prefill.items())} if sp else {},
            "decode": {str(i): list(r) for i, r in sorted(sp.decode.items())} if sp else {}}


def print_split(split: dict) -> None:
    """The human-readable report of ``--phase-split``."""
    if not split["fits"]:
        print(f"phase split: does not fit ({split['layer_slots']} layer slots < {split['needed']}: "
              "each side must hold the whole model)")
        return
    verdict = "faster than the plan" if split["split_wins"] else "not faster than the plan"
    print(f"phase split: {split['split_tokens_per_s']:.2f} tokens/s simulated against the plan's "
          f"{split['plan_tokens_per_s']:.2f} ({verdict}; {split['window_s']:.0f} s, sim seed 1)")
    for side in ("prefill", "decode"):
        ranges = ", ".join(f"{i}:[{s},{e})" for i, (s, e) in split[side].items())
        print(f"  {side:8s} {ranges}")


def _check(args: argparse.Namespace, cluster, root):
    """The simulation check of ``--check-window`` (None when off)."""
    if args.check_window <= 0:
        return None
    from p2pserve.helix import format as hf
    from p2pserve.sim.plan_check import simulation_check

    return simulation_check(hf.load_cluster(cluster), args.model, duration=args.check_window, root=root)


def print_solution(topo: Topology, model: str, plan: Solution) -> None:
    """The human-readable report: ranges per node, flows, bounds, estimates, warnings."""
    print(f"cluster {topo.name}: {topo.num_nodes} nodes, model {model} ({topo.num_layers} layers)")
    print(f"objective {plan.objective}, method {plan.method}")
    for i, (s, e) in sorted(plan.assignments.items(), key=lambda x: (x[1], x[0])):
        node = topo.nodes[i]
        print(f"  {node.name:16s} {node.gpu_type:6s} layers [{s:3d}, {e:3d})  ({e - s} of max {node.max_layers})")
    idle = [topo.nodes[i].name for i in range(topo.num_nodes) if i not in plan.assignments]
    if idle:
        print(f"  idle: {', '.join(idle)}")
    est = plan.estimate
    print(f"max-flow            {plan.max_flow:10.2f} tokens/s")
    print(f"upper bound         {plan.upper_bound:10.2f} tokens/s (Helix), covering bound {plan.covering_bound:.2f}")
    print(f"gap to best bound   {plan.solver_gap * 100:9.2f} %")
    print(f"depth (mean/max)    {est.mean_depth:10.2f} / {est.max_depth}")
    print(f"est. token latency  {est.per_token_latency_s:10.3f} s")
    print(f"est. decode tput    {est.decode_tokens_per_s:10.2f} tokens/s (KV-limited concurrency {est.concurrency:.0f})")
    print(f"solve time          {plan.solve_time_s:10.2f} s")
    for w in plan.warnings:
        print(f"warning: {w}")
