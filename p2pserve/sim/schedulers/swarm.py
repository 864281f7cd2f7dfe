"""Swarm-style routing: pick the next stage in proportion to its real-time throughput.

SWARM parallelism's "stochastic wiring" sends work to a next-stage peer with probability
proportional to that peer's measured throughput. Here the throughput of a candidate stage is the
node's measured token-layers per busy second (an exponentially weighted average kept by the
node; a profile-based prior before it has run) divided by the layers the stage would run.
"""

from __future__ import annotations

import random
from typing import Sequence

from p2pserve.sim.request import Query
from p2pserve.sim.schedulers.base import HopByHopScheduler, SchedulerView
from p2pserve.sim.topology import SINK, Edge


class SwarmScheduler(HopByHopScheduler):
    """Throughput-proportional random choice of the next hop."""

    name = "swarm"

    def __init__(self, rng: random.Random):
        self.rng = rng

    def choose(self, u: int, candidates: Sequence[Edge], query: Query, view: SchedulerView) -> Edge:
        """Sample a candidate with weight = stage throughput (tokens/s)."""
        if len(candidates) == 1:
            return candidates[0]
        weights = []
        for e in candidates:
            if e.dst == SINK or e.stage is None:
                weights.append(1.0)
            else:
                weights.append(max(view.speed(e.dst), 1e-9) / e.stage.layers)
        return self.rng.choices(candidates, weights=weights, k=1)[0]
