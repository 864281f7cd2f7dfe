"""How few layers can a re-placement load and still reach a flow? A provable answer.

The churn target asks an incremental re-solve to reach a share of a full re-solve's max-flow
while loading at most a fraction of the layers the full re-solve loads. A search that misses
such a target leaves open whether any placement could meet it. This module closes that question
with a bound that holds for every placement.

**The layer-cover bound.** Every token crosses layer ``l`` on exactly one node that holds ``l``,
and node ``i`` passes at most ``T_i(k_i)`` tokens/s when it holds ``k_i`` layers (partial
inference uses a node's capacity once, whatever part of its range a token uses). So for any
placement the max-flow is at most ``min_l sum_{i holds l} T_i(k_i)``. Links and the contiguity
of paths can only lower the real flow below this cover.

**The MILP.** Each node picks at most one range from its candidates; a range's cost is the
layers the node must newly load to hold it (what it holds now is free). Asking for a cover of at
least ``F`` at every layer while minimising the total cost is a small set multi-cover with a
knapsack (:func:`fewest_moves_for_flow`); the highest cover under a budget of moves is found
by bisection on it (``tools/move_ceiling.py``, an analysis for the benchmark). HiGHS solves it with the planner
MILP's thread count: HiGHS keeps one scheduler per process and refuses, at once and silently
("Not Set"), a model that asks for another. Its dual bound is a proof even when the time limit
stops it before optimality, so a bound above the churn budget proves the target out of reach
for that start, not merely unfound.

The optimal cover placement is also a good start for the churn search itself: it often is a
real placement whose max-flow equals its cover (:mod:`churn` evaluates it with the true
max-flow before using it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from p2pserve.placement.milp.backends import solve
from p2pserve.placement.milp.linear import LinearModel
from p2pserve.placement.moves import new_layer_count
from p2pserve.placement.topology import Topology

Placement = dict[int, tuple[int, int]]


@dataclass(frozen=True)
class Candidate:
    """A range node ``node`` may hold, its throughput there and the layers it must load."""

    node: int
    start: int
    end: int
    throughput: float
    cost: int


@dataclass(frozen=True)
class MoveBound:
    """Result of the cover MILP (:func:`fewest_moves_for_flow`).

    ``lower`` is proven: no placement reaching the asked flow loads fewer layers (``None`` when
    no placement can reach it at all within the candidates). ``placement`` is the best cover
    placement found, ``optimal`` whether the solver closed its gap, ``status`` its words.
    """

    lower: int | None
    placement: Placement | None
    optimal: bool
    status: str


def candidates(topo: Topology, current: Mapping[int, tuple[int, int]], max_cost: int) -> list[Candidate]:
    """Every range each node can hold with a positive throughput that loads at most ``max_cost``
    new layers. Sub-ranges of what a node holds now cost nothing and are all included."""
    L = topo.num_layers
    out = []
    for i, node in enumerate(topo.nodes):
        old = current.get(i)
        for k in range(1, min(node.max_layers, L) + 1):
            t = node.throughput[k]
            if t <= 0:
                continue
            for s in range(0, L - k + 1):
                cost = new_layer_count(old, s, s + k)
                if cost <= max_cost:
                    out.append(Candidate(i, s, s + k, t, cost))
    return out


def _model(topo: Topology, cands: list[Candidate]) -> tuple[LinearModel, list[int]]:
    m = LinearModel()
    cols = [m.var(f"x[{c.node},{c.start},{c.end}]", 0.0, 1.0, True) for c in cands]
    per_node: dict[int, dict[int, float]] = {}
    for col, c in zip(cols, cands):
        per_node.setdefault(c.node, {})[col] = 1.0
    for row in per_node.values():
        m.row(row, hi=1.0)  # one range per node
    return m, cols


def _cover_rows(m: LinearModel, topo: Topology, cands: list[Candidate], cols: list[int], target: float) -> None:
    """``cover >= target`` at every layer. Coefficient tightening: one range of T >= target
    covers its layers alone, so capping T at the target keeps every 0/1 solution and takes from
    the LP relaxation the fractions of fast ranges it would otherwise cover layers with."""
    by_layer: list[dict[int, float]] = [{} for _ in range(topo.num_layers)]
    for col, c in zip(cols, cands):
        for layer in range(c.start, c.end):
            by_layer[layer][col] = min(c.throughput, target)
    for row in by_layer:
        m.row(row, lo=target)


def _placement(cands: list[Candidate], cols: list[int], x: list[float] | None) -> Placement | None:
    if x is None:
        return None
    return {c.node: (c.start, c.end) for col, c in zip(cols, cands) if x[col] > 0.5}


def fewest_moves_for_flow(
    topo: Topology,
    current: Mapping[int, tuple[int, int]],
    target_flow: float,
    max_cost: int,
    time_limit_s: float = 30.0,
    start: Mapping[int, tuple[int, int]] | None = None,
) -> MoveBound:
    """Fewest layers to load for a layer cover of at least ``target_flow``, over placements
    that load at most ``max_cost`` layers in all.

    ``lower`` is a proof: a placement with max-flow >= ``target_flow`` loads at least ``lower``
    layers, or, when ``lower`` is ``None``, more than ``max_cost``. ``start``, a placement that
    meets both, gives the solver an incumbent to improve on.
    """
    cands = candidates(topo, current, max_cost)
    m, cols = _model(topo, cands)
    for col, c in zip(cols, cands):
        m.obj[col] = -float(c.cost)  # the backends maximise
    m.row({col: float(c.cost) for col, c in zip(cols, cands)}, hi=float(max_cost))
    _cover_rows(m, topo, cands, cols, target_flow)
    starts = []
    if start is not None:
        held = {(c.node, c.start, c.end) for c in cands}
        if all((i, s, e) in held for i, (s, e) in start.items() if e > s):
            starts.append([1.0 if start.get(c.node) == (c.start, c.end) else 0.0 for c in cands])
    # Default settings: the planner MILP's thread count, which HiGHS requires process-wide.
    res = solve(m, time_limit_s, starts, "highs")
    placement = _placement(cands, cols, res.x)
    if res.status == "Infeasible":
        return MoveBound(None, None, True, res.status)
    # Costs are integers, so the proven lower bound rounds up (less a tolerance for the
    # solver's floating point).
    bound = -res.bound if math.isfinite(res.bound) else 0.0
    lower = max(0, math.ceil(bound - 1e-6))
    found = None if placement is None else sum(new_layer_count(current.get(i), s, e) for i, (s, e) in placement.items())
    return MoveBound(lower, placement, found is not None and found <= lower, res.status)
