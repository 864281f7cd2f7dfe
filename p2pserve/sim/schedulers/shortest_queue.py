"""Shortest-queue-first: go to the next node holding the fewest queued tokens right now."""

from __future__ import annotations

import random
from typing import Sequence

from p2pserve.sim.graph import Edge
from p2pserve.sim.request import Query
from p2pserve.sim.schedulers.base import HopByHopScheduler, SchedulerView
from p2pserve.types import SINK_INDEX


class ShortestQueueScheduler(HopByHopScheduler):
    """Least queued tokens wins; ties are broken by a seeded RNG, not by node order."""

    name = "shortest-queue"

    def __init__(self, rng: random.Random):
        self.rng = rng

    def choose(self, u: int, candidates: Sequence[Edge], query: Query, view: SchedulerView) -> Edge:
        """The candidate whose node has the shortest queue."""
        best: list[Edge] = []
        best_q = None
        for e in candidates:
            q = 0 if e.dst == SINK_INDEX else view.queued_tokens(e.dst)
            if best_q is None or q < best_q:
                best, best_q = [e], q
            elif q == best_q:
                best.append(e)
        return best[0] if len(best) == 1 else best[self.rng.randrange(len(best))]
