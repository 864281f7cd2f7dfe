"""Petals-style routing: the route with the smallest estimated latency.

Petals' client builds an inference chain by a shortest-path search where a hop costs the
network latency to reach a server plus the time that server needs for the blocks it runs.
Here a stage costs: link latency + the profiled time of its layers for this job + the time to
drain the tokens already queued at the node (at its measured speed). The search is a dynamic
program over the routing DAG (every edge moves strictly forward in layers).
"""

from __future__ import annotations

from p2pserve.sim.graph import Edge
from p2pserve.sim.request import Query, Stage
from p2pserve.sim.schedulers.base import Scheduler, SchedulerView
from p2pserve.types import SINK_INDEX, SOURCE_INDEX


class PetalsScheduler(Scheduler):
    """Minimum estimated latency path over admissible edges."""

    name = "petals"

    def route(self, query: Query, view: SchedulerView) -> tuple[Stage, ...] | None:
        """Shortest path source -> sink; vertices are settled in order of the layer they end at."""
        graph = view.graph
        nodes = graph.assignments
        # Edge costs use decode-token time: Petals optimises the per-token inference chain.
        best: dict[int, tuple[float, Edge | None]] = {SOURCE_INDEX: (0.0, None)}
        order = [SOURCE_INDEX] + sorted(nodes, key=lambda i: nodes[i].end)
        for u in order:
            if u not in best:
                continue
            base = best[u][0]
            for e in graph.out_edges.get(u, ()):
                if e.stage is not None and not view.admissible(e.stage, query):
                    continue
                cost = base + graph.latency(u, e.dst)
                if e.stage is not None:
                    v = e.dst
                    speed = view.speed(v)
                    wait = view.queued_tokens(v) * nodes[v].layers / speed if speed > 0 else 0.0
                    cost += e.stage.layers * view.layer_time(v, 1, False) + wait
                if e.dst not in best or cost < best[e.dst][0]:
                    best[e.dst] = (cost, e)
        if SINK_INDEX not in best:
            return None
        stages: list[Stage] = []
        v = SINK_INDEX
        while v != SOURCE_INDEX:
            e = best[v][1]
            assert e is not None
            if e.stage is not None:
                stages.append(e.stage)
            v = e.src
        return tuple(reversed(stages))
