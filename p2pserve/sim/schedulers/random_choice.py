"""Random scheduling: every admissible next hop is equally likely (the paper's ablation)."""

from __future__ import annotations

import random
from typing import Sequence

from p2pserve.sim.graph import Edge
from p2pserve.sim.request import Query
from p2pserve.sim.schedulers.base import HopByHopScheduler, SchedulerView


class RandomScheduler(HopByHopScheduler):
    """Uniform choice among admissible out-edges, from an injected seeded RNG."""

    name = "random"

    def __init__(self, rng: random.Random):
        self.rng = rng

    def choose(self, u: int, candidates: Sequence[Edge], query: Query, view: SchedulerView) -> Edge:
        """Any candidate, uniformly."""
        return candidates[self.rng.randrange(len(candidates))]
