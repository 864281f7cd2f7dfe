"""Helix's scheduler, IWRR over max-flow edge flows (Helix §5.1), run by the client's own router.

The simulator does not re-implement IWRR: it drives :class:`p2pserve.client.routing.Router`, the
code every client runs, through a thin adapter. Simulator node ``i`` is peer ``"n{i}"``, the
coordinator's source and sink are the router's ``"source"`` / ``"sink"``, and the flows become the
router's :class:`~p2pserve.client.routing.RouteGraph`. So the simulated figures measure the
router clients run: per-vertex interleaved weighted round-robin over integer weights quantised
from the flows, each client's cycle starting at a seeded offset.

What the adapter adds, all of it Helix's:

* edges carrying under ``min_share`` (5%) of their vertex's outflow are dropped before the router
  sees the flows (tiny flows are solver noise, not capacity worth a pipeline);
* the shared admission masks (prompt cap, KV estimate) become the router's per-peer masks: a
  node is masked when its whole span is inadmissible for the query. (A client's peers announce
  free KV per token of their span, so a client cannot tell a stage entering mid-span from one
  running it all; for such a stage this masks slightly earlier than a per-stage check would.)
* a route exists only over flow edges: when every flow route is masked the router would fall
  back to any edge the spans allow, but a Helix coordinator holds the query until a flow route
  frees up, so the adapter answers None (the query waits) instead.
"""

from __future__ import annotations

from typing import Mapping

from p2pserve.client.routing import Masks, RouteGraph, Router
from p2pserve.errors import NoRouteError
from p2pserve.sim.graph import StageGraph
from p2pserve.sim.request import Query, Stage
from p2pserve.sim.schedulers.base import Scheduler, SchedulerView, route_edges
from p2pserve.types import SINK, SINK_INDEX, SOURCE, SOURCE_INDEX

#: Helix masks edges carrying less than this share of their vertex's outflow.
MIN_SHARE = 0.05


def routable_flows(flows: Mapping[tuple[int, int], float], min_share: float = MIN_SHARE) -> dict[tuple[int, int], float]:
    """The positive flows carrying at least ``min_share`` of their tail vertex's outflow."""
    outflow: dict[int, float] = {}
    for (u, _v), f in flows.items():
        outflow[u] = outflow.get(u, 0.0) + f
    return {(u, v): f for (u, v), f in flows.items() if f > 0.0 and f >= min_share * outflow[u]}


def peer_id(node: int) -> str:
    """The router's name for simulator vertex ``node`` (source and sink keep theirs)."""
    if node == SOURCE_INDEX:
        return SOURCE
    if node == SINK_INDEX:
        return SINK
    return f"n{node}"


def route_graph(graph: StageGraph, flows: Mapping[tuple[int, int], float]) -> RouteGraph:
    """The client's view of a plan: every serving node's span and the flows, by peer id."""
    return RouteGraph(
        num_layers=graph.num_layers,
        spans={peer_id(i): (a.start, a.end) for i, a in graph.assignments.items()},
        flows={(peer_id(u), peer_id(v)): f for (u, v), f in flows.items()},
    )


class IwrrScheduler(Scheduler):
    """Per-vertex IWRR over flow weights: a client :class:`Router` seeded with ``seed``."""

    name = "iwrr"

    def __init__(self, flows: Mapping[tuple[int, int], float], graph: StageGraph, seed: int = 0,
                 min_share: float = MIN_SHARE) -> None:
        self.flows = routable_flows(flows, min_share)
        self.router = Router(route_graph(graph, self.flows), seed=seed)
        self._spans = {i: Stage(i, a.start, a.end) for i, a in graph.assignments.items()}
        self._node = {peer_id(i): i for i in graph.assignments}

    def route(self, query: Query, view: SchedulerView) -> tuple[Stage, ...] | None:
        """The router's next pipeline under this query's masks, or None (no flow route now)."""
        masked = frozenset(peer_id(i) for i, span in self._spans.items() if not view.admissible(span, query))
        try:
            ids = self.router.route_ids(Masks(overloaded=masked))
        except NoRouteError:
            return None
        stages, at = [], 0
        for pid in ids:
            node = self._node[pid]
            end = self._spans[node].end
            stages.append(Stage(node, at, end))
            at = end
        route = tuple(stages)
        if not all(edge in self.flows for edge in route_edges(route)):
            return None  # the router's fallback left the flows: wait for a flow route instead
        return route
