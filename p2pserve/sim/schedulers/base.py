"""The scheduler interface: pick a per-request pipeline (a route of stages) for a query.

A scheduler is a small policy. The simulator hands it a :class:`SchedulerView` -- the routing
graph, the shared admission masks (KV estimate, prompt size) and a few live measurements -- and
the scheduler answers with a route or ``None`` (nothing admissible now; the query waits).
Most policies decide hop by hop, like Helix's per-vertex IWRR: :class:`HopByHopScheduler`
walks source -> sink and asks :meth:`HopByHopScheduler.choose` at every vertex, backing up
when a choice leads only to masked nodes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol, Sequence

from p2pserve.sim.graph import Edge, StageGraph
from p2pserve.sim.request import Query, Stage
from p2pserve.types import SINK_INDEX, SOURCE_INDEX


class SchedulerView(Protocol):
    """What a scheduler may look at (implemented by the simulator, or by a test stub)."""

    graph: StageGraph

    def admissible(self, stage: Stage, query: Query) -> bool:
        """False when ``stage`` is masked for this query (its node's KV estimate, prompt cap)."""

    def queued_tokens(self, node: int) -> int:
        """Tokens of jobs inside ``node`` now."""

    def speed(self, node: int) -> float:
        """Real-time token-layers per second of ``node`` (a prior before it has run)."""

    def layer_time(self, node: int, tokens: int, prompt: bool) -> float:
        """Profiled seconds for one layer of ``node`` to run a batch of ``tokens``."""


class Scheduler(ABC):
    """A routing policy; subclasses are pure apart from their own counters and seeded RNG."""

    name = "base"

    @abstractmethod
    def route(self, query: Query, view: SchedulerView) -> tuple[Stage, ...] | None:
        """A source-to-sink route for ``query``, or None when no admissible route exists."""

    def on_decode(self, query: Query) -> None:
        """A decode step of ``query`` starts on its route (IWRR charges its edges)."""

    def on_finish(self, query: Query) -> None:
        """``query`` finished; release per-query state."""


class HopByHopScheduler(Scheduler):
    """Walk source -> sink choosing one out-edge per vertex among the admissible ones."""

    def candidates(self, u: int, query: Query, view: SchedulerView) -> list[Edge]:
        """Admissible out-edges of ``u`` (subclasses may filter further)."""
        return [e for e in view.graph.out_edges.get(u, ()) if e.stage is None or view.admissible(e.stage, query)]

    @abstractmethod
    def choose(self, u: int, candidates: Sequence[Edge], query: Query, view: SchedulerView) -> Edge:
        """Pick one of the non-empty ``candidates`` at vertex ``u``."""

    def commit(self, edges: list[Edge], query: Query) -> None:
        """Called once a complete route was found (IWRR updates its loads here)."""

    def route(self, query: Query, view: SchedulerView) -> tuple[Stage, ...] | None:
        """Depth-first walk in the policy's order, backing up from dead ends.

        At each vertex the policy picks among the admissible out-edges; if everything beyond
        the pick is masked (say the KV estimate rules out a node three hops on), the walk backs
        up and asks the policy again without that edge. A vertex found dead stays dead for this
        query: what lies beyond a node does not depend on how the walk reached it.
        """
        dead: set[int] = set()
        edges: list[Edge] = []
        if not self._walk(SOURCE_INDEX, query, view, dead, edges):
            return None
        self.commit(edges, query)
        return tuple(e.stage for e in edges if e.stage is not None)

    def _walk(self, u: int, query: Query, view: SchedulerView, dead: set[int], edges: list[Edge]) -> bool:
        cands = [e for e in self.candidates(u, query, view) if e.dst not in dead]
        while cands:
            e = self.choose(u, cands, query, view)
            edges.append(e)
            if e.dst == SINK_INDEX or self._walk(e.dst, query, view, dead, edges):
                return True
            edges.pop()
            dead.add(e.dst)
            cands = [c for c in cands if c.dst != e.dst]
        return False


def route_edges(route: Sequence[Stage]) -> list[tuple[int, int]]:
    """The ``(u, v)`` vertex pairs a route uses, source and sink included."""
    out = []
    prev = SOURCE_INDEX
    for st in route:
        out.append((prev, st.node))
        prev = st.node
    out.append((prev, SINK_INDEX))
    return out
