"""Swarm-style routing: pick the next stage in proportion to its real-time throughput.

SWARM parallelism's "stochastic wiring" sends work to a next-stage peer with probability
proportional to that peer's measured throughput. Here the throughput of a candidate stage is the
node's measured token-layers per busy second (an exponentially weighted average kept by the
node; a profile-based prior before it has run) divided by the layers the stage would run.
"""

from __future__ import annotations

import random
from typing import Sequence

from p2pserve.sim.graph import Edge
from p2pserve.sim.request import Query
from p2pserve.sim.schedulers.base import HopByHopScheduler, SchedulerView
from p2pserve.types import SINK_INDEX


class SwarmScheduler(HopByHopScheduler):
    """Throughput-proportional random choice of the next hop.

    ``greedy`` (scheduler ``swarm-greedy``) takes the fastest candidate instead of sampling
    (ties broken at random). The Helix paper describes its Swarm baseline only as scheduling
    "based on real-time throughput of each candidate node"; the two readings bracket how much
    the baseline's figures depend on that rule (see docs/sim.md).
    """

    name = "swarm"

    def __init__(self, rng: random.Random, greedy: bool = False):
        self.rng = rng
        self.greedy = greedy

    def choose(self, u: int, candidates: Sequence[Edge], query: Query, view: SchedulerView) -> Edge:
        """Sample a candidate with weight = stage throughput (tokens/s), or take the fastest."""
        if len(candidates) == 1:
            return candidates[0]
        weights = []
        for e in candidates:
            if e.dst == SINK_INDEX or e.stage is None:
                weights.append(1.0)
            else:
                weights.append(max(view.speed(e.dst), 1e-9) / e.stage.layers)
        if self.greedy:
            top = max(weights)
            return self.rng.choice([e for e, w in zip(candidates, weights) if w >= top * (1 - 1e-9)])
        return self.rng.choices(candidates, weights=weights, k=1)[0]
