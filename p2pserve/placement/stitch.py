"""Stitching cell plans into one plan over the whole swarm.

Cells are disjoint sets of nodes, so the union of their placements is a placement and the sum of
their flows is a feasible flow of the whole graph: every node and link carries what its cell's
max-flow gave it, within its capacity. That flow is what the swarm publishes (a client's route
stays inside one cell, inside one region) and what the decode estimate is computed from, so the
whole swarm is never put through one max-flow of ``n^2`` candidate edges. It is a lower bound on
the whole graph's max-flow: edges between cells may carry more.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from p2pserve.placement.estimate import estimate
from p2pserve.placement.maxflow import FlowResult
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


def stitched_flow(flows: Flows) -> FlowResult:
    """The summed cell flows as a :class:`FlowResult` (value: what leaves the source)."""
    value = sum(f for (u, _v), f in flows.items() if u == SOURCE_INDEX)
    node_flows: dict[int, float] = {}
    for (_u, v), f in flows.items():
        if v != SINK_INDEX:
            node_flows[v] = node_flows.get(v, 0.0) + f
    return FlowResult(value, dict(flows), node_flows)


def stitched_solution(topo: Topology, placement: Placement, flows: Flows, config: PlannerConfig,
                      solve_time_s: float, method: str, stats: dict) -> Solution:
    """A :class:`Solution` of the whole topology from stitched cell placements and flows."""
    flow = stitched_flow(flows)
    est = estimate(topo, placement, flow, config.workload, config.partial)
    ub = topo.upper_bound()
    cover = topo.covering_upper_bound()
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
