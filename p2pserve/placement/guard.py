"""The publish guard: the planner never returns a placement a validated check ranks below the
best heuristic baseline it also computed.

Why: the search optimises an estimate (or max-flow), and an estimate can be wrong exactly where
the search goes. On the geo-distributed cluster the decode estimate puts the 24-hop balanced
chain at 169 tokens/s while the simulator serves 32 (every hop may cross a 50 ms region
boundary). So before publishing, the final candidate and the baselines are scored by a ``check``
-- in practice a short simulation (``p2pserve.sim.plan_check.simulation_check``); this module
stays pure, so the check comes in as a callable -- and the best one wins. Ties go to the
planner's own candidate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from p2pserve.placement.topology import Topology

Placement = Mapping[int, tuple[int, int]]
#: placement -> validated score (higher is better), e.g. simulated decode tokens/s.
Check = Callable[[Placement], float]
#: topology -> its check, or None where the topology carries too little to check (a coordinator
#: builds its topology every round, so it is handed a factory, e.g.
#: ``p2pserve.sim.plan_check.live_check``).
CheckFactory = Callable[[Topology], Optional[Check]]
#: The name of the planner's own candidate in a :class:`GuardResult`.
FINAL = "final"


@dataclass(frozen=True)
class GuardResult:
    """What the guard chose and every candidate's check score (``FINAL`` is the planner's)."""

    chosen: str
    placement: dict[int, tuple[int, int]]
    scores: dict[str, float]

    @property
    def overruled(self) -> bool:
        """True when a baseline beat the planner's own candidate."""
        return self.chosen != FINAL

    def to_stats(self) -> dict:
        """JSON-friendly summary for ``Solution.stats["guard"]``."""
        return {"chosen": self.chosen, "scores": {k: round(v, 3) for k, v in self.scores.items()}}


def guard(final: Placement, baselines: Mapping[str, Placement], check: Check) -> GuardResult:
    """Score ``final`` and each of ``baselines`` with ``check``; return the best (ties: ``final``).

    Identical placements are checked once (a baseline equal to ``final`` adds nothing).
    """
    scores: dict[str, float] = {FINAL: float(check(final))}
    seen = [dict(final)]
    best_name, best = FINAL, dict(final)
    for name, p in baselines.items():
        p = dict(p)
        if not p or p in seen:
            continue
        seen.append(p)
        scores[name] = float(check(p))
        if scores[name] > scores[best_name]:
            best_name, best = name, p
    return GuardResult(best_name, {i: (r[0], r[1]) for i, r in best.items()}, scores)
