"""Request schedulers: Helix IWRR, random, shortest-queue, Swarm-style and Petals-style."""

from __future__ import annotations

import random
from typing import Mapping

from p2pserve.errors import ConfigError
from p2pserve.sim.graph import StageGraph
from p2pserve.sim.schedulers.base import HopByHopScheduler, Scheduler, SchedulerView, route_edges
from p2pserve.sim.schedulers.iwrr import IwrrScheduler
from p2pserve.sim.schedulers.petals import PetalsScheduler
from p2pserve.sim.schedulers.random_choice import RandomScheduler
from p2pserve.sim.schedulers.shortest_queue import ShortestQueueScheduler
from p2pserve.sim.schedulers.swarm import SwarmScheduler

SCHEDULERS = ("iwrr", "random", "shortest-queue", "swarm", "swarm-greedy", "petals")


def make_scheduler(
    name: str, flows: Mapping[tuple[int, int], float], rng: random.Random, graph: StageGraph
) -> Scheduler:
    """Build the scheduler called ``name`` for ``graph``; ``flows`` feed IWRR, ``rng`` seeds IWRR's
    router and drives the random ones."""
    if name == "iwrr":
        return IwrrScheduler(flows, graph, seed=rng.getrandbits(32))
    if name == "random":
        return RandomScheduler(rng)
    if name == "shortest-queue":
        return ShortestQueueScheduler(rng)
    if name in ("swarm", "swarm-greedy"):
        return SwarmScheduler(rng, greedy=name == "swarm-greedy")
    if name == "petals":
        return PetalsScheduler()
    raise ConfigError(f"unknown scheduler {name!r}; expected one of {', '.join(SCHEDULERS)}")


__all__ = [
    "SCHEDULERS",
    "HopByHopScheduler",
    "IwrrScheduler",
    "PetalsScheduler",
    "RandomScheduler",
    "Scheduler",
    "SchedulerView",
    "ShortestQueueScheduler",
    "SwarmScheduler",
    "make_scheduler",
    "route_edges",
]
