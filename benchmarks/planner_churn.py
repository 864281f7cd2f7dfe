"""The churn section of ``benchmarks/planner.py``: cluster24 loses or gains nodes; how fast, how
well and with how few layer moves does the planner recover, and what could it have reached at all.

Run it through ``python benchmarks/planner.py`` (``--skip methods unseen simulator backends``
for this section alone); see that module's docstring and docs/planner.md.
"""

from __future__ import annotations

import random
import time

from p2pserve.helix.root import data_root
from p2pserve.helix.topology import load_helix_topology
from p2pserve.placement.churn import on_join, on_leave, resolve
from p2pserve.placement.move_bound import fewest_moves_for_flow
from p2pserve.placement.moves import by_index, by_name, layers_to_load
from p2pserve.placement.planner import PlannerConfig, plan_for_topology
from p2pserve.placement.relabel import interchangeable_groups, relabel_for_fewest_moves
from p2pserve.placement.solution import validate_placement
from p2pserve.placement.topology import Topology
from tools.lanes import fewest_moves_recut
from tools.move_ceiling import max_cover_within

#: The churn runs on this cluster and model (the methods section's first entry).
CLUSTER, MODEL = "clusters/single_cluster/cluster24.ini", "llama2-70b"


def churn_section(args, tl: float, print_table) -> list[dict]:
    """Run :func:`bench_churn` per objective in ``args.objective`` and print its two tables."""
    out = []
    for objective in args.objective:
        rows = bench_churn(tl, min(10.0, tl), reload_shares=tuple(args.reload_share), objective=objective,
                           tolerances=tuple(args.tolerance), lane_check_s=args.lane_check)
        out.extend(rows)
        print_table(f"churn on cluster24 ({objective} objective, from our {objective} plan)", rows,
                    ["scenario", "reload_share", "tolerance", "coverage_held", "time_to_first_valid_s",
                     "time_to_valid_plan_s", "share_of_full", "decode_share_of_full", "layers_moved",
                     "full_resolve_layers_moved", "moved_ratio", "full_resolve_layers_moved_relabelled",
                     "moved_ratio_relabelled", "valid", "lane_check"])
        print_table(f"churn target reachable at all? ({objective}; fewest moves for 95 % of the full re-solve's "
                    "max-flow, proven by the layer-cover MILP)",
                    [{"scenario": r["scenario"], **r["proof"]} for r in rows
                     if r["reload_share"] == args.reload_share[0] and r["tolerance"] == args.tolerance[0]],
                    ["scenario", "proven_fewest_moves", "proof_closed", "proof_time_s", "budget_raw",
                     "budget_relabelled", "reachable_raw", "reachable_relabelled", "share_ceiling_raw",
                     "share_ceiling_relabelled"])
    return out


def bench_churn(tl_full: float, tl_inc: float, seed: int = 0, reload_shares: tuple[float, ...] = (5e-3,),
                objective: str = "max-flow", tolerances: tuple[float, ...] = (0.0,),
                lane_check_s: float = 0.0) -> list[dict]:
    """Churn on cluster24 starting from our plan for ``objective`` (same objective throughout).

    Each scenario's 60 s full re-solve runs once; the incremental re-solve then runs once per
    reload cost in ``reload_shares`` (a share of the starting plan's objective per moved layer),
    which traces the trade-off between what it recovers and what it moves; and once per
    ``tolerances`` value (0: the reload price alone; > 0: fewest moves within that share of the
    best objective found, see ``fewest_moves.fewest_moves_within``).

    The full re-solve's moves are reported twice: raw, and after relabelling interchangeable
    nodes onto the current placement (``relabel.relabel_for_fewest_moves``; what deploying it would
    really load, and the strict budget: ``moved_ratio_relabelled``). With ``lane_check_s`` > 0,
    each scenario also gets an exhaustive search of the lane neighbourhood
    (``tools/lanes.fewest_moves_recut``, target 95 % of the full re-solve): the fewest moves it
    finds, or the move count below which it proved nothing reaches the target.
    """
    full_topo = load_helix_topology(data_root() / CLUSTER, MODEL)
    cfg_full = PlannerConfig(objective=objective, time_limit_s=tl_full)
    start = plan_for_topology(full_topo, cfg_full)
    current = by_name(full_topo, start.assignments)
    rng = random.Random(seed)
    results = []
    # Reload cost: a layer move must buy ``reload_share`` of the current objective (a layer
    # takes about a minute to load, amortised over the plan's lifetime).
    value = start.max_flow if objective == "max-flow" else start.estimate.decode_tokens_per_s
    cfg_inc = PlannerConfig(objective=objective, time_limit_s=tl_inc, use_milp=False)
    for kind, count in [("remove", 1), ("remove", 2), ("remove", 4), ("add", 2)]:
        gone = rng.sample(range(full_topo.num_nodes), count)
        topo, before = _churned(full_topo, current, kind, gone, objective, tl_inc)
        full = plan_for_topology(topo, cfg_full)
        full_moved = layers_to_load(before, by_name(topo, full.assignments))
        full_rel = relabel_for_fewest_moves(topo, full.assignments, before)
        full_moved_rel = layers_to_load(before, by_name(topo, full_rel))
        proof = bench_proof(topo, before, full.max_flow, full_moved, full_moved_rel,
                            ceiling_s=30.0 if objective == "max-flow" else 0.0)
        lane = _lane_check(topo, before, full, full_rel, objective, cfg_full, lane_check_s) if lane_check_s > 0 else None
        fixed = {"objective": objective, "scenario": f"{kind} {count}", "nodes": [full_topo.nodes[i].name for i in gone],
                 "full_resolve_layers_moved": full_moved, "full_resolve_layers_moved_relabelled": full_moved_rel,
                 "lane_check": lane, "proof": proof}
        for share, tol in [(sh, tol) for tol in tolerances for sh in reload_shares]:
            row = _churn_step(topo, before, kind, cfg_inc, share * value, tl_inc, tol, full, full_moved, full_moved_rel)
            results.append({**fixed, "reload_share": share, "tolerance": tol, **row})
    return results


def _churned(full_topo: Topology, current: dict, kind: str, gone: list[int], objective: str, tl_inc: float):
    """The topology after the churn and the placement before it (by name): ``remove`` drops
    ``gone`` from our plan; ``add`` starts from a plan without them and brings them back."""
    if kind == "remove":
        topo, _ = full_topo.without(gone)
        return topo, current
    small, _ = full_topo.without(gone)
    base = plan_for_topology(small, PlannerConfig(objective=objective, time_limit_s=tl_inc))
    return full_topo, by_name(small, base.assignments)


def _lane_check(topo, before, full, full_rel, objective: str, cfg_full: PlannerConfig, lane_check_s: float) -> dict:
    """The lane neighbourhood searched exhaustively for 95 % of the full re-solve's objective."""
    from p2pserve.placement.planner import throughput_score
    from p2pserve.placement.search import max_flow_score

    val = max_flow_score(topo) if objective == "max-flow" else throughput_score(topo, cfg_full)
    cur_idx = by_index(topo, before)
    goal = 0.95 * val(full.assignments)
    found, st = fewest_moves_recut(topo, cur_idx, cur_idx, interchangeable_groups(topo), val, goal,
                                   lane_check_s, lambda q: not validate_placement(topo, q),
                                   reach=12, donors=[full_rel])
    return {"moves": layers_to_load(before, by_name(topo, found)) if found else None,
            "proven_none_below": st["proven_below"], "evaluations": st["evaluations"],
            "combinations": st["combinations"]}


def _churn_step(topo, before, kind: str, cfg_inc: PlannerConfig, reload_cost: float, tl_inc: float, tol: float,
                full, full_moved: int, full_moved_rel: int) -> dict:
    """One incremental re-solve after the churn, and its row of the table."""
    t0 = time.monotonic()
    if kind == "remove":
        res = on_leave(topo, before, cfg_inc, reload_cost, time_limit_s=tl_inc, tolerance=tol)
        immediate = res
        if not res.resolved:
            # Coverage held: serving continues on the flows-only plan at once; the
            # warm-started re-solve then gets its 10 s to win back what was lost.
            res = resolve(topo, before, cfg_inc, reload_cost, tl_inc, tolerance=tol)
    else:
        res = on_join(topo, before, cfg_inc, reload_cost, time_limit_s=tl_inc, tolerance=tol)
        immediate = None
    inc_time = time.monotonic() - t0
    flows_only = immediate is not None and not immediate.resolved
    est, full_est = res.plan.estimate.decode_tokens_per_s, full.estimate.decode_tokens_per_s
    return {
        "coverage_held": not validate_placement(topo, by_index(topo, before)) if kind == "remove" else None,
        "time_to_valid_plan_s": round(inc_time, 3),
        "time_to_first_valid_s": round(immediate.elapsed_s, 3) if flows_only
        else (None if res.first_valid_s is None else round(res.first_valid_s, 3)),
        "flows_only_share_of_full": round(immediate.plan.max_flow / full.max_flow, 4)
        if flows_only and full.max_flow else None,
        "resolved": res.resolved,
        "valid": not validate_placement(topo, res.plan.assignments),
        "max_flow": round(res.plan.max_flow, 2),
        "full_resolve_max_flow": round(full.max_flow, 2),
        "share_of_full": round(res.plan.max_flow / full.max_flow, 4) if full.max_flow else None,
        "est_decode": round(est, 1),
        "full_est_decode": round(full_est, 1),
        "decode_share_of_full": round(est / full_est, 4) if full_est else None,
        "layers_moved": res.layers_moved,
        "moved_ratio": round(res.layers_moved / full_moved, 3) if full_moved else None,
        "moved_ratio_relabelled": round(res.layers_moved / full_moved_rel, 3) if full_moved_rel else None,
    }


def bench_proof(topo, before, full_flow: float, full_moved: int, full_moved_rel: int, share: float = 0.95,
                ceiling_s: float = 0.0) -> dict:
    """Is the churn target reachable at all? The fewest layers any placement must load for a
    max-flow of ``share`` x the full re-solve's, proven by the layer-cover MILP
    (``move_bound.fewest_moves_for_flow``) over placements loading at most as many layers as the
    full re-solve (raw). ``proven_fewest_moves`` None means more than that. The quarter budgets
    are a quarter of the full re-solve's moves, raw and relabelled. With ``ceiling_s`` > 0, also
    the proven ceiling on the share any placement within each quarter budget can reach
    (``tools/move_ceiling.max_cover_within``, at most ``ceiling_s`` each; the cover bound is tight for
    chains, loose for parallel pipelines)."""
    t0 = time.monotonic()
    res = fewest_moves_for_flow(topo, by_index(topo, before), share * full_flow, full_moved, time_limit_s=60.0)
    out = {"share": share, "proven_fewest_moves": res.lower, "proof_closed": res.optimal or res.lower is None,
           "proof_status": res.status, "proof_time_s": round(time.monotonic() - t0, 2),
           "budget_raw": full_moved / 4, "budget_relabelled": full_moved_rel / 4}
    low = full_moved + 1 if res.lower is None else res.lower
    out["reachable_raw"] = low <= full_moved / 4
    out["reachable_relabelled"] = low <= full_moved_rel / 4
    if ceiling_s > 0:
        for name, moved in (("raw", full_moved), ("relabelled", full_moved_rel)):
            ceiling = max_cover_within(topo, by_index(topo, before), int(moved / 4), time_limit_s=ceiling_s)
            out[f"share_ceiling_{name}"] = round(ceiling.cover_upper / full_flow, 3)
    return out
