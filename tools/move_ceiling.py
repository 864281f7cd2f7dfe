"""The highest max-flow any re-placement within a move budget can reach: a proven ceiling.

An analysis for ``benchmarks/planner.py`` (churn section), off the product path: it asks the
layer-cover MILP of :mod:`p2pserve.placement.move_bound` a sequence of questions, bisecting on
the flow target, to bound from above what the churn search could have found within a quarter
of a full re-solve's moves.

The layer cover of a placement, ``min_l sum_{i holds l} T_i(k_i)``, bounds its max-flow (see
``move_bound``); the cover bound is tight for chains, loose for parallel pipelines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping

from p2pserve.placement.move_bound import Placement, fewest_moves_for_flow
from p2pserve.placement.topology import Topology


@dataclass(frozen=True)
class MoveCeiling:
    """Result of :func:`max_cover_within`.

    ``cover_upper`` is proven: no placement that loads at most the budget has a max-flow above
    it. ``placement`` is the best cover placement found, ``optimal`` whether the bisection
    closed to its tolerance, ``status`` how it ended.
    """

    cover_upper: float
    placement: Placement | None
    optimal: bool
    status: str


def cover_of(topo: Topology, placement: Mapping[int, tuple[int, int]]) -> float:
    """The layer-cover bound of one placement: ``min_l sum_{i holds l} T_i(k_i)``."""
    per_layer = [0.0] * topo.num_layers
    for i, (s, e) in placement.items():
        if e > s:
            for layer in range(s, e):
                per_layer[layer] += topo.nodes[i].throughput[e - s]
    return min(per_layer) if per_layer else 0.0


def max_cover_within(
    topo: Topology,
    current: Mapping[int, tuple[int, int]],
    budget: int,
    time_limit_s: float = 60.0,
    tolerance: float = 0.005,
) -> MoveCeiling:
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
            return MoveCeiling(0.0, best, True, "no placement within the budget covers every layer")
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
    return MoveCeiling(hi, best, hi - lo <= tolerance * hi, status)
