"""Searching a prefill/decode split (sim/disagg.py): which nodes run prompts, by GPU type.

A split is a count of nodes per GPU type on the prefill side (the first ones of each type, in
node order); the rest decode. The climb starts from the nodes with the largest prefill-over-decode
speed (``advantage_start``). The prefill side is placed by the planner with Helix's max-flow
objective (prompts are throughput work), the decode side by the planner's default (decode)
objective; each candidate is scored by a simulation of the split. The search climbs from a start
by adding or removing one node of one type at a time, keeping a move only when it scores more
than ``min_gain`` better, so that it does not climb on a short window's noise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from p2pserve.errors import P2PServeError
from p2pserve.placement.planner import PlannerConfig, plan_for_topology
from p2pserve.placement.topology import Topology
from p2pserve.sim.disagg import SplitPlacement

Counts = Mapping[str, int]


def nodes_by_type(topo: Topology) -> dict[str, list[int]]:
    """Node indices of each GPU type, in node order."""
    out: dict[str, list[int]] = {}
    for i, n in enumerate(topo.nodes):
        out.setdefault(n.gpu_type, []).append(i)
    return out


def split_placement(topo: Topology, counts: Counts, work: int = 2000, seed: int = 0) -> SplitPlacement:
    """The split with ``counts`` nodes of each type prefilling, both sides planned (see module
    docstring); raises :class:`P2PServeError` when a side cannot hold the model."""
    by_type = nodes_by_type(topo)
    pre = [i for t, k in counts.items() for i in by_type.get(t, [])[:k]]
    dec = [i for i in range(topo.num_nodes) if i not in set(pre)]

    def planned(nodes: list[int], objective: str) -> dict[int, tuple[int, int]]:
        sol = plan_for_topology(topo.subset(nodes), PlannerConfig(objective=objective, work=work, seed=seed))
        return {nodes[i]: r for i, r in sol.assignments.items() if r[1] > r[0]}

    return SplitPlacement(planned(pre, "max-flow"), planned(dec, "throughput"))


def advantage_start(topo: Topology) -> dict[str, int]:
    """Where a climb starts: nodes by comparative advantage for prompts (one layer's prefill
    tokens/s over its decode tokens/s at a 64-token batch: a GPU whose decode is strong for its
    compute is worth more on the decode side), added one by one until they hold one copy."""
    from p2pserve.sim.profiles import LayerLatency

    def advantage(i: int) -> float:
        profile = topo.nodes[i].profile
        if profile is None:
            return 0.0
        lat = LayerLatency.from_profile(profile)
        return (1000 / lat.prompt(1000)) / (64 / lat.decode(64))

    counts: dict[str, int] = {}
    held = 0
    for i in sorted(range(topo.num_nodes), key=lambda i: (-advantage(i), i)):
        if held >= topo.num_layers:
            break
        counts[topo.nodes[i].gpu_type] = counts.get(topo.nodes[i].gpu_type, 0) + 1
        held += topo.nodes[i].max_layers
    return counts


def layer_slots(topo: Topology) -> int:
    """How many layers the nodes can hold between them."""
    return sum(n.max_layers for n in topo.nodes)


def full_split_fits(topo: Topology) -> bool:
    """Whether the nodes can hold two whole copies of the model at all (one per side)."""
    return layer_slots(topo) >= 2 * topo.num_layers


@dataclass
class SplitSearch:
    """The climb's result: the best counts, their score, and every candidate scored."""

    counts: dict[str, int]
    score: float
    placement: SplitPlacement | None
    tried: list[tuple[dict[str, int], float]] = field(default_factory=list)


def search_split(topo: Topology, start: Counts, score: Callable[[SplitPlacement], float],
                 min_gain: float = 0.01, max_candidates: int = 60, work: int = 2000,
                 place: Callable[[Counts], SplitPlacement] | None = None) -> SplitSearch:
    """Hill-climb over prefill counts per type from ``start`` (see module docstring); ``place``
    turns counts into a split (default :func:`split_placement` with ``work``)."""
    by_type = nodes_by_type(topo)
    place = place if place is not None else (lambda counts: split_placement(topo, counts, work))
    seen: dict[tuple, tuple[float, SplitPlacement | None]] = {}

    def scored(counts: dict[str, int]) -> tuple[float, SplitPlacement | None]:
        key = tuple(sorted(counts.items()))
        if key not in seen:
            try:
                sp = place(counts)
                seen[key] = (score(sp), sp)
            except P2PServeError:  # a side that cannot hold the model
                seen[key] = (0.0, None)
            result.tried.append((dict(counts), seen[key][0]))
        return seen[key]

    result = SplitSearch(dict(start), 0.0, None)
    result.score, result.placement = scored(result.counts)
    improved = True
    while improved and len(seen) < max_candidates:
        improved = False
        for t in by_type:
            for step in (1, -1):
                c = dict(result.counts)
                c[t] = c.get(t, 0) + step
                if not 0 <= c[t] <= len(by_type[t]):
                    continue
                if c[t] == 0:
                    del c[t]
                value, sp = scored(c)
                if value > result.score * (1 + min_gain):
                    result.counts, result.score, result.placement, improved = c, value, sp, True
    return result
