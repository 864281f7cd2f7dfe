"""Stitching cell plans into one plan over the whole swarm.

Cells are disjoint sets of nodes, so the union of their placements is a placement and the sum of
their flows is a feasible flow of the whole graph: every node and link carries what its cell's
max-flow gave it, within its capacity. That flow is what the swarm publishes (a client's route
stays inside one cell, inside one region) and what the decode estimate is computed from, so the
whole swarm is never put through one max-flow of ``n^2`` candidate edges. It is a lower bound on
the whole graph's max-flow: edges between cells may carry more.

Clients route in proportion to the published flows, and requests in flight are what a cell's KV
cache holds. A cell whose flow share exceeds its share of the swarm's concurrency fills its KV
first and caps everyone's admission, while one far away (higher per-token latency) with a large
flow slows the average token. So :func:`balance` scales each cell's flows down (never up: the
result stays feasible) until every cell's flow is proportional to the requests it can hold
(measured: 120 nodes in 5 regions, cells' estimates summing to 2,468 decode tokens/s, the
stitched estimate rises from 1,997 unbalanced to the balanced figure in docs/planner.md).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from p2pserve.placement.cells import cell_topologies
from p2pserve.placement.estimate import WorkloadModel, estimate
from p2pserve.placement.maxflow import FlowResult, max_flow
from p2pserve.placement.planner import PlannerConfig
from p2pserve.placement.solution import Solution, validate_placement
from p2pserve.placement.topology import Topology
from p2pserve.types import SINK_INDEX, SOURCE_INDEX

Placement = dict[int, tuple[int, int]]
Flows = dict[tuple[int, int], float]


def to_global(cell: Sequence[int], placement: Mapping[int, tuple[int, int]],
              flows: Mapping[tuple[int, int], float]) -> tuple[Placement, Flows]:
    """A cell's placement and flows (cell-local indices) in the whole topology's indices."""

    def g(i: int) -> int:
        return i if i in (SOURCE_INDEX, SINK_INDEX) else cell[i]

    return ({cell[i]: (int(s), int(e)) for i, (s, e) in placement.items()},
            {(g(u), g(v)): f for (u, v), f in flows.items()})


def balance(flows: Sequence[Flows], concurrency: Sequence[float]) -> list[Flows]:
    """Each cell's flows scaled by ``a_c <= 1`` so that its flow out of the source is proportional
    to ``concurrency[c]`` (requests in flight it can hold); cells without flow or concurrency
    keep theirs."""
    value = [sum(f for (u, _v), f in fl.items() if u == SOURCE_INDEX) for fl in flows]
    ratios = [v / n for v, n in zip(value, concurrency) if v > 0 and n > 0]
    if not ratios:
        return [dict(fl) for fl in flows]
    k = min(ratios)
    out = []
    for fl, v, n in zip(flows, value, concurrency):
        a = k * n / v if v > 0 and n > 0 else 1.0
        out.append({e: f * a for e, f in fl.items()})
    return out


def stitched_flow(flows: Flows) -> FlowResult:
    """The summed cell flows as a :class:`FlowResult` (value: what leaves the source)."""
    value = sum(f for (u, _v), f in flows.items() if u == SOURCE_INDEX)
    node_flows: dict[int, float] = {}
    for (_u, v), f in flows.items():
        if v != SINK_INDEX:
            node_flows[v] = node_flows.get(v, 0.0) + f
    return FlowResult(value, dict(flows), node_flows)


def cell_flows(topo: Topology, placement: Mapping[int, tuple[int, int]], cells: Sequence[Sequence[int]],
               model: WorkloadModel = WorkloadModel()) -> FlowResult:
    """The flows a swarm planned in ``cells`` routes by: each cell's own max-flow over its links,
    balanced as :func:`balance` does, summed (:func:`stitched_flow`).

    Nodes in no cell, and the nodes of cells that do not serve the whole model on their own (a
    cell still loading after a re-plan), are pooled into one more group with a max-flow of its
    own, so what they can serve together is still used. Routed by one max-flow over the whole
    swarm instead, the plan of ``benchmarks/scale.py`` at 256 nodes simulates at 0.85x (its
    routes cross cells and regions, and the scheduler alternates between twins of every cell).
    """
    cells = [[i for i in c if i in placement] for c in cells]
    covered = [c for c in cells if c and _covers(topo, placement, c)]
    inside = {i for c in covered for i in c}
    rest = [i for i in sorted(placement) if i not in inside]
    groups = covered + ([rest] if rest else [])
    parts: list[Flows] = []
    held: list[float] = []
    for group, sub in zip(groups, cell_topologies(topo, groups)):
        local = {x: placement[i] for x, i in enumerate(group)}
        fr = max_flow(sub, local)
        parts.append(to_global(group, local, fr.edge_flows)[1])
        held.append(estimate(sub, local, fr, model).concurrency if fr.value > 0 else 0.0)
    flows: Flows = {}
    for part in balance(parts, held):
        flows.update(part)
    return stitched_flow(flows)


def _covers(topo: Topology, placement: Mapping[int, tuple[int, int]], nodes: Sequence[int]) -> bool:
    """Whether ``nodes`` hold every layer between them."""
    held = [False] * topo.num_layers
    for i in nodes:
        s, e = placement[i]
        held[s:e] = [True] * (e - s)
    return all(held)


def twin_share(placement: Mapping[int, tuple[int, int]], cells: Sequence[Sequence[int]]) -> float:
    """Share of placed nodes whose range another node *of the same cell* also holds."""
    placed = [i for c in cells for i in c if i in placement]
    if not placed:
        return 0.0
    twins = 0
    for c in cells:
        ranges = [placement[i] for i in c if i in placement]
        counts: dict[tuple[int, int], int] = {}
        for r in ranges:
            counts[r] = counts.get(r, 0) + 1
        twins += sum(1 for r in ranges if counts[r] > 1)
    return twins / len(placed)


def cell_workload(config: PlannerConfig, placement: Mapping[int, tuple[int, int]],
                  cells: Sequence[Sequence[int]]) -> WorkloadModel:
    """The estimate's workload model with its twin penalty counted inside cells only.

    The estimate slows tokens through nodes whose range has an identical twin (the scheduler
    alternates between twins at every stage, fragmenting convoys). Flows never leave a cell, so
    a node only ever alternates with twins of its own cell; equal cells repeat every range,
    and counting twins across cells would charge every node. The weight is rescaled so that
    ``weight x global twin share`` equals ``weight x in-cell twin share``.
    """
    model = config.workload
    ranges = list(placement.values())
    counts: dict[tuple[int, int], int] = {}
    for r in ranges:
        counts[r] = counts.get(r, 0) + 1
    glob = sum(1 for r in ranges if counts[r] > 1) / len(ranges) if ranges else 0.0
    if glob <= 0:
        return model
    return replace(model, aligned_weight=model.aligned_weight * twin_share(placement, cells) / glob)


def stitched_solution(topo: Topology, placement: Placement, flows: Flows, config: PlannerConfig,
                      solve_time_s: float, method: str, stats: dict,
                      cells: Sequence[Sequence[int]] | None = None,
                      covering_bound: float | None = None) -> Solution:
    """A :class:`Solution` of the whole topology from stitched cell placements and flows (the
    estimate counts range twins inside ``cells`` only, :func:`cell_workload`, when given).

    ``covering_bound``: a known covering bound to report instead of computing it (a knapsack
    over every node, a second at a thousand nodes); the bound of a swarm is also one of any
    swarm it loses nodes from, which is how a re-plan uses it.
    """
    flow = stitched_flow(flows)
    model = config.workload if cells is None else cell_workload(config, placement, cells)
    est = estimate(topo, placement, flow, model, config.partial)
    ub = topo.upper_bound()
    cover = topo.covering_upper_bound() if covering_bound is None else covering_bound
    bound = min(x for x in (ub, cover) if x > 0) if ub > 0 else 0.0
    gap = (bound - flow.value) / bound if bound > 0 else float("nan")
    return Solution(
        assignments=dict(sorted(placement.items())),
        node_names={i: topo.nodes[i].name for i in range(topo.num_nodes)},
        flows=dict(flow.edge_flows),
        max_flow=flow.value,
        upper_bound=ub,
        covering_bound=cover,
        solver_bound=bound,
        solver_gap=max(0.0, gap),
        solve_time_s=solve_time_s,
        objective=config.objective,
        method=method,
        estimate=est,
        warnings=tuple(validate_placement(topo, placement)),
        stats=stats,
    )
