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
knapsack (:func:`fewest_moves_for_flow`); the highest cover under a budget of moves
(:func:`max_cover_within`) is found by bisection on it. HiGHS solves it with the planner
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
import time
from dataclasses import dataclass
from typing import Mapping

from p2pserve.placement.milp import LinearModel, MilpOptions
from p2pserve.placement.milp_backends import solve
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
    """Result of a cover MILP.

    ``lower`` is proven: no placement reaching the asked flow loads fewer layers (for
    :func:`fewest_moves_for_flow`; ``None`` when no placement can reach it at all within the
    candidates). ``cover_upper`` is proven: no placement within the move budget has a max-flow
    above it (for :func:`max_cover_within`). ``placement`` is the best cover placement found,
    ``optimal`` whether the solver closed its gap, ``status`` its words.
    """

    lower: int | None
    cover_upper: float | None
    placement: Placement | None
    optimal: bool
    status: str


def new_layer_count(old: tuple[int, int] | None, s: int, e: int) -> int:
    """Layers a node holding ``old`` (or nothing) must load to hold ``[s, e)``."""
    if old is None:
        return e - s
    return (e - s) - max(0, min(e, old[1]) - max(s, old[0]))


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


def cover_of(topo: Topology, placement: Mapping[int, tuple[int, int]]) -> float:
    """The layer-cover bound of one placement: ``min_l sum_{i holds l} T_i(k_i)``."""
    per_layer = [0.0] * topo.num_layers
    for i, (s, e) in placement.items():
        if e > s:
            for layer in range(s, e):
                per_layer[layer] += topo.nodes[i].throughput[e - s]
    return min(per_layer) if per_layer else 0.0


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
    res = solve(m, time_limit_s, starts, "highs", MilpOptions(), None)
    placement = _placement(cands, cols, res.x)
    if res.status == "Infeasible":
        return MoveBound(None, None, None, True, res.status)
    # Costs are integers, so the proven lower bound rounds up (less a tolerance for the
    # solver's floating point).
    bound = -res.bound if math.isfinite(res.bound) else 0.0
    lower = max(0, math.ceil(bound - 1e-6))
    found = None if placement is None else sum(new_layer_count(current.get(i), s, e) for i, (s, e) in placement.items())
    return MoveBound(lower, None, placement, found is not None and found <= lower, res.status)


def max_cover_within(
    topo: Topology,
    current: Mapping[int, tuple[int, int]],
    budget: int,
    time_limit_s: float = 60.0,
    tolerance: float = 0.005,
) -> MoveBound:
    """Highest layer cover of any placement loading at most ``budget`` layers.

    ``cover_upper`` is a proof: no placement that loads at most ``budget`` layers has a
    max-flow above it. Found by bisection on the target of :func:`fewest_moves_for_flow`,
    whose capped rows solve far faster than maximising the cover directly (its LP relaxation
    is weak). Every step that lowers ``cover_upper`` is a proven infeasibility; a step the
    time limit cuts short ends the bisection where it stands. ``placement`` has the best cover
    found (the current placement's at worst); ``optimal`` means the two ends are within
    ``tolerance`` of each other.
    """
    t0 = time.monotonic()
    best = {i: r for i, r in current.items() if 0 <= i < topo.num_nodes and r[1] > r[0]}
    lo = cover_of(topo, best)
    hi = topo.covering_upper_bound()  # a placement's weakest layer is at most its average one
    status = "bisection"
    if lo <= 0:
        # Can the budget cover every layer at all? If not, bisecting would only halve ``hi``
        # towards zero, one slow proof at a time.
        floor = 1e-6 * max(hi, 1.0)
        if fewest_moves_for_flow(topo, current, floor, budget, time_limit_s).lower is None:
            return MoveBound(None, 0.0, best, True, "no placement within the budget covers every layer")
    while hi - lo > tolerance * hi:
        left = time_limit_s - (time.monotonic() - t0)
        if left < 0.5:
            status = "time limit reached"
            break
        mid = 0.5 * (lo + hi)
        res = fewest_moves_for_flow(topo, current, mid, budget, left)
        if res.lower is None:
            hi = mid  # proven: nothing within the budget reaches mid
        elif res.placement is not None and cover_of(topo, res.placement) >= mid - 1e-9:
            best, lo = res.placement, cover_of(topo, res.placement)
        else:
            status = f"undecided at {mid:.1f}: {res.status}"
            break
    return MoveBound(None, hi, best, hi - lo <= tolerance * hi, status)
