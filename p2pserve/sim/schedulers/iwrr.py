"""Helix's scheduler: interleaved weighted round-robin over max-flow edge flows (Helix §5.1).

Each vertex's candidates are its out-edges weighted by their flow in the max-flow solution.
A new query walks source -> sink choosing ``argmin_i load_i + w / flow_i`` with ``w`` the prompt
length, then charges ``load_i += w / flow_i``; every decode step charges ``1 / flow`` to each
edge of its fixed route. Choosing the smallest finishing "virtual time" spreads queries in
proportion to the flows without bursts. Edges carrying under 5% of their vertex's outflow are
masked (tiny flows are solver noise, not capacity worth a pipeline), as are nodes the shared KV
estimate and prompt cap rule out.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from p2pserve.sim.request import Query
from p2pserve.sim.schedulers.base import HopByHopScheduler, SchedulerView, route_edges
from p2pserve.sim.topology import Edge


class IwrrScheduler(HopByHopScheduler):
    """Per-vertex IWRR over flow weights."""

    name = "iwrr"

    def __init__(self, flows: Mapping[tuple[int, int], float], min_share: float = 0.05):
        self.flows = dict(flows)
        self.min_share = min_share
        outflow: dict[int, float] = {}
        for (u, _v), f in self.flows.items():
            outflow[u] = outflow.get(u, 0.0) + f
        self.outflow = outflow
        self.load: dict[tuple[int, int], float] = {key: 0.0 for key in self.flows}
        # 1/flow per route edge, cached per query for the per-decode charge
        self._inv: dict[int, list[tuple[tuple[int, int], float]]] = {}

    def candidates(self, u: int, query: Query, view: SchedulerView) -> list[Edge]:
        """Admissible edges carrying at least ``min_share`` of ``u``'s outflow."""
        floor = self.min_share * self.outflow.get(u, 0.0)
        flows = self.flows
        return [
            e
            for e in view.topology.out_edges.get(u, ())
            if flows.get((u, e.dst), 0.0) >= floor
            and flows.get((u, e.dst), 0.0) > 0.0
            and view.admissible(e, query)
        ]

    def choose(self, u: int, candidates: Sequence[Edge], query: Query, view: SchedulerView) -> Edge:
        """The candidate whose load after taking this prompt would be smallest."""
        w = query.input_len
        load, flows = self.load, self.flows
        return min(candidates, key=lambda e: load[(u, e.dst)] + w / flows[(u, e.dst)])

    def commit(self, edges: list[Edge], query: Query) -> None:
        """Charge the prompt to every edge of the chosen route."""
        w = query.input_len
        inv = []
        for e in edges:
            key = (e.src, e.dst)
            c = 1.0 / self.flows[key]
            self.load[key] += w * c
            inv.append((key, c))
        self._inv[query.qid] = inv

    def on_decode(self, query: Query) -> None:
        """Charge one token along the query's route."""
        load = self.load
        for key, c in self._inv[query.qid]:
            load[key] += c

    def on_finish(self, query: Query) -> None:
        """Forget the query's cached route."""
        self._inv.pop(query.qid, None)


__all__ = ["IwrrScheduler", "route_edges"]
