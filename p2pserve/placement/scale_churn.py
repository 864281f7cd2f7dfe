"""Re-planning a cell-decomposed swarm after peers leave: only the damaged cells move.

A cell that lost no node keeps its ranges and its flows. A cell that lost nodes but still serves
every layer keeps its ranges too; only its max-flow is recomputed (no layer loads). A cell whose
remaining nodes no longer cover the model gets the cheapest repairs
(:func:`recut.repair` of the holes, then an order-keeping re-cut, each charged the layers it
loads), then a short search on the cell's objective minus a reload cost
per newly loaded layer, so the fewest-moves trade of :mod:`churn` holds cell by cell. The search's
evaluations are one budget for the whole re-plan (``work``), shared evenly by the cells that need
a repair, so a re-plan costs about the same however many cells lost nodes. Equal damage in equal
cells is solved once. Every step has a work budget: the same inputs give the
same plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

from p2pserve.placement.cells import cell_key, cell_topologies
from p2pserve.placement.estimate import estimate
from p2pserve.placement.maxflow import max_flow
from p2pserve.placement.moves import NamedPlacement, layers_to_load, new_layer_count
from p2pserve.placement.planner import PlannerConfig, throughput_score
from p2pserve.placement.recut import chain_order, chain_rebalance, repair
from p2pserve.placement.search import improve, max_flow_score
from p2pserve.placement.solution import Solution, validate_placement
from p2pserve.placement.stitch import Flows, Placement, balance, stitched_solution, to_global
from p2pserve.placement.topology import Topology

#: A re-cut start keeps at least this share of the repaired placement's flow.
RECUT_FLOOR = 0.8


@dataclass(frozen=True)
class CellRepair:
    """What happened to one cell: ``kept`` (no node left), ``flows`` (ranges kept, flows
    recomputed) or ``repaired`` (layers loaded), and how many layers it loads."""

    cell: int
    action: str
    layers_moved: int


@dataclass(frozen=True)
class ScaleReplan:
    """A re-plan: the whole swarm's solution, layers loaded, and what each damaged cell did."""

    plan: Solution
    layers_moved: int
    repairs: tuple[CellRepair, ...]
    elapsed_s: float


def replan_after_leave(topo: Topology, current: NamedPlacement, cells: Sequence[Sequence[str]],
                       config: PlannerConfig | None = None, reload_share: float = 0.01, work: int = 300,
                       clock: Callable[[], float] = time.monotonic,
                       covering_bound: float | None = None) -> ScaleReplan:
    """Re-plan ``topo`` (the swarm after the leaves) from ``current`` (node name -> range) over
    ``cells`` (node names, as :func:`scale.cells_by_name` gives them); see module docstring.

    ``reload_share``: a newly loaded layer costs this share of the cell's score per layer.
    ``work``: search evaluations for the whole re-plan, shared by the cells to repair.
    ``covering_bound``: the plan's covering bound before the leaves (still a bound after them;
    reported instead of recomputing it).
    """
    config = config or PlannerConfig()
    t0 = clock()
    index = {n.name: i for i, n in enumerate(topo.nodes)}
    alive = [(c, [index[x] for x in names if x in index]) for c, names in enumerate(cells)]
    alive = [(c, members) for c, members in alive if members]
    live = [members for _, members in alive]
    topos = cell_topologies(topo, live)
    memo: dict[Hashable, tuple[Placement, Flows, str, float]] = {}
    placement: Placement = {}
    parts: list[Flows] = []
    concurrency: list[float] = []
    repairs: list[CellRepair] = []
    moved = 0
    states: list[Placement] = [
        {x: (current[sub.nodes[x].name][0], current[sub.nodes[x].name][1])
         for x in range(sub.num_nodes) if sub.nodes[x].name in current}
        for sub in topos]
    keys = [(cell_key(sub), tuple(sorted(cur.items()))) for sub, cur in zip(topos, states)]
    broken = {k for k, sub, cur in zip(keys, topos, states) if validate_placement(sub, cur)}
    share = work // max(1, len(broken))
    for (c, members), sub, cur, key in zip(alive, topos, states, keys):
        lost = len(cells[c]) != len(members)
        if key not in memo:
            memo[key] = _repair_cell(sub, cur, config, reload_share, share)
        p, f, action, n_kv = memo[key]
        gp, gf = to_global(members, p, f)
        placement.update(gp)
        parts.append(gf)
        concurrency.append(n_kv)
        n_moved = layers_to_load({sub.nodes[x].name: r for x, r in cur.items()},
                                 {sub.nodes[x].name: r for x, r in p.items()})
        moved += n_moved
        if lost or n_moved:
            repairs.append(CellRepair(c, action, n_moved))
    flows: Flows = {}
    for f in balance(parts, concurrency):
        flows.update(f)
    sol = stitched_solution(topo, placement, flows, config, clock() - t0, "scale(replan)", {}, cells=live,
                            covering_bound=covering_bound)
    return ScaleReplan(sol, moved, tuple(repairs), clock() - t0)


def _repair_cell(sub: Topology, cur: Placement, config: PlannerConfig, reload_share: float,
                 work: int) -> tuple[Placement, Flows, str, float]:
    """The cell's new placement, its flows, the action taken (see module docstring) and the
    requests in flight it can hold (the stitch balances flows by it)."""
    if not validate_placement(sub, cur):
        fr = max_flow(sub, cur, config.partial)
        if fr.value > 0:
            n_kv = estimate(sub, cur, fr, config.workload, config.partial).concurrency
            return dict(cur), dict(fr.edge_flows), "flows", n_kv
    base = max_flow_score(sub, config.partial) if config.objective == "max-flow" else throughput_score(sub, config)
    starts = [repair(sub, cur)]
    scale = max(base(starts[0]), 1e-9)
    cost = reload_share * scale / max(1, sub.num_layers)

    def score(p: dict[int, tuple[int, int]]) -> float:
        return base(p) - cost * sum(new_layer_count(cur.get(i), s, e) for i, (s, e) in p.items())

    # Re-cuts at flows below 0.8x the repair's are not worth their DP (each flow value is one).
    floor = RECUT_FLOOR * max_flow(sub, starts[0], config.partial).value
    recut = chain_rebalance(sub, chain_order(starts[0]), cur, cost, floor or None)
    if recut:
        starts.append(recut)
    starts = [p for p in starts if not validate_placement(sub, p)] or starts
    best, _ = improve(sub, starts, score, float("inf"), seed=config.seed, max_evals=work)
    fr = max_flow(sub, best, config.partial)
    n_kv = estimate(sub, best, fr, config.workload, config.partial).concurrency
    return dict(best), dict(fr.edge_flows), "repaired", n_kv
