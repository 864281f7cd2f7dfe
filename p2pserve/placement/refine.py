"""Refinement on the validated check: a seeded hill-climb whose score is the check itself.

Why: the decode estimate ranks placements well on average (Spearman ~0.98 where it was fitted)
but its optimum is not the simulator's: on cluster24 one or two search moves away from the
estimate's best placement the simulator finds placements it serves faster that the estimate
scores lower. With a check that costs seconds (a short simulation), a few hundred of them
after the estimate's search climb the rest of the way. Pure: the check is a callable; the
moves are the search's (``search._neighbour``), seeded, so the same inputs, seed and budget
give the same placement.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Mapping

from p2pserve.placement.search import _neighbour
from p2pserve.placement.solution import validate_placement
from p2pserve.placement.topology import Topology

Placement = dict[int, tuple[int, int]]


@dataclass(frozen=True)
class RefineStats:
    """What a refinement did: checks spent, improvements, the check's score before and after."""

    checks: int
    improvements: int
    start_score: float
    best_score: float

    def to_stats(self) -> dict:
        """JSON-friendly summary for ``Solution.stats["refine"]``."""
        return {"checks": self.checks, "improvements": self.improvements,
                "start_score": round(self.start_score, 3), "best_score": round(self.best_score, 3)}


def refine(topo: Topology, start: Mapping[int, tuple[int, int]], check: Callable[[Placement], float],
           checks: int, seed: int = 0, max_moves: int = 2) -> tuple[Placement, RefineStats]:
    """First-improvement hill-climb on ``check`` from ``start`` for ``checks`` evaluations.

    Each candidate is 1..``max_moves`` random search moves from the incumbent; invalid or
    already-seen candidates cost nothing.
    """
    rng = random.Random(seed)
    movable = list(range(topo.num_nodes))
    best: Placement = {i: (r[0], r[1]) for i, r in start.items()}
    best_s = start_s = float(check(best))
    seen = {_key(best)}
    used, improvements, tries = 1, 0, 0
    while used < checks and tries < 50 * checks:
        tries += 1
        q = dict(best)
        for _ in range(rng.randint(1, max_moves)):
            q = _neighbour(topo, q, rng, movable) or q
        key = _key(q)
        if key in seen or validate_placement(topo, q):
            continue
        seen.add(key)
        s = float(check(q))
        used += 1
        if s > best_s:
            best, best_s, improvements = q, s, improvements + 1
    return best, RefineStats(used, improvements, start_s, best_s)


def _key(p: Mapping[int, tuple[int, int]]) -> tuple:
    return tuple(sorted(p.items()))
