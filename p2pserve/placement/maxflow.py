"""Max-flow of a placement: the graph of Helix §4.3.

Each compute node i becomes two vertices ``in_i -> out_i`` whose edge capacity is ``T_i[k_i]``
(tokens/s holding ``k_i`` layers). Edges:

* ``source -> in_i`` when i holds layer 0 (capacity: link bandwidth / bytes per token id);
* ``out_i -> sink`` when i holds the last layer;
* ``out_i -> in_j`` when j holds the layer needed right after i: with partial inference
  ``s_j <= e_i < e_j`` (j runs only ``[e_i, e_j)``), without it ``e_i == s_j``
  (capacity: link bandwidth / bytes per activation).

Two engines: a small Dinic written for the planner's inner loop (thousands of evaluations per
second of search) and networkx's preflow-push, used as the reference and cross-checked in tests.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Mapping

from p2pserve.placement.topology import Topology
from p2pserve.types import SINK_INDEX, SOURCE_INDEX

#: node index -> half-open layer range [start, end)
Placement = Mapping[int, tuple[int, int]]

_EPS = 1e-9


@dataclass(frozen=True)
class FlowResult:
    """Max-flow value (tokens/s) and the flow on each used edge.

    ``edge_flows`` maps ``(u, v)`` to tokens/s with u, v node indices or ``SOURCE_INDEX``/``SINK_INDEX``;
    ``node_flows[i]`` is the flow through node i.
    """

    value: float
    edge_flows: dict[tuple[int, int], float]
    node_flows: dict[int, float]


def placement_edges(
    topo: Topology, placement: Placement, partial: bool = True
) -> list[tuple[int, int, float]]:
    """The valid directed edges ``(u, v, capacity)`` between nodes/source/sink for a placement."""
    L = topo.num_layers
    edges: list[tuple[int, int, float]] = []
    items = [(i, r) for i, r in placement.items() if r is not None and r[1] > r[0]]
    for i, (s, e) in items:
        if s == 0:
            cap = topo.capacity(SOURCE_INDEX, i)
            if cap > 0:
                edges.append((SOURCE_INDEX, i, cap))
        if e == L:
            cap = topo.capacity(i, SINK_INDEX)
            if cap > 0:
                edges.append((i, SINK_INDEX, cap))
    for i, (si, ei) in items:
        if ei >= L:
            continue
        for j, (sj, ej) in items:
            if i == j:
                continue
            ok = (sj <= ei < ej) if partial else (sj == ei)
            if not ok:
                continue
            cap = topo.capacity(i, j)
            if cap > 0:
                edges.append((i, j, cap))
    return edges


class _Dinic:
    """Dinic's algorithm on a small graph with float capacities."""

    def __init__(self, n: int):
        self.n = n
        self.head: list[list[int]] = [[] for _ in range(n)]
        self.to: list[int] = []
        self.cap: list[float] = []

    def add(self, u: int, v: int, c: float) -> int:
        self.head[u].append(len(self.to))
        self.to.append(v)
        self.cap.append(c)
        self.head[v].append(len(self.to))
        self.to.append(u)
        self.cap.append(0.0)
        return len(self.to) - 2

    def run(self, s: int, t: int) -> float:
        total = 0.0
        to, cap, head = self.to, self.cap, self.head
        while True:
            level = [-1] * self.n
            level[s] = 0
            q = deque([s])
            while q:
                u = q.popleft()
                for eid in head[u]:
                    if cap[eid] > _EPS and level[to[eid]] < 0:
                        level[to[eid]] = level[u] + 1
                        q.append(to[eid])
            if level[t] < 0:
                return total
            it = [0] * self.n

            def dfs(u: int, f: float) -> float:
                if u == t:
                    return f
                edges = head[u]
                while it[u] < len(edges):
                    eid = edges[it[u]]
                    v = to[eid]
                    if cap[eid] > _EPS and level[v] == level[u] + 1:
                        got = dfs(v, min(f, cap[eid]))
                        if got > _EPS:
                            cap[eid] -= got
                            cap[eid ^ 1] += got
                            return got
                    it[u] += 1
                return 0.0

            while True:
                f = dfs(s, float("inf"))
                if f <= _EPS:
                    break
                total += f


def max_flow(
    topo: Topology, placement: Placement, partial: bool = True, engine: str = "dinic"
) -> FlowResult:
    """Max-flow from source to sink for ``placement`` (see module docstring).

    ``engine`` is ``"dinic"`` (fast, default) or ``"networkx"`` (preflow-push, reference).
    """
    edges = placement_edges(topo, placement, partial)
    nodes = [i for i, r in placement.items() if r is not None and r[1] > r[0]]
    if engine == "networkx":
        return _max_flow_networkx(topo, placement, nodes, edges)
    # vertex ids: 0 = source, 1 = sink, 2+2p = in of p-th node, 3+2p = out
    pos = {i: p for p, i in enumerate(nodes)}
    g = _Dinic(2 + 2 * len(nodes))
    node_eid = {}
    for i in nodes:
        s, e = placement[i]
        k = e - s
        thr = topo.nodes[i].throughput
        t = thr[k] if k < len(thr) else 0.0
        node_eid[i] = g.add(2 + 2 * pos[i], 3 + 2 * pos[i], t)
    edge_eid = {}
    for u, v, c in edges:
        a = 0 if u == SOURCE_INDEX else 3 + 2 * pos[u]
        b = 1 if v == SINK_INDEX else 2 + 2 * pos[v]
        edge_eid[(u, v)] = g.add(a, b, c)
    caps0 = list(g.cap)
    value = g.run(0, 1)
    flows = {}
    for key, eid in edge_eid.items():
        f = caps0[eid] - g.cap[eid]
        if f > _EPS:
            flows[key] = f
    node_flows = {i: caps0[eid] - g.cap[eid] for i, eid in node_eid.items()}
    return FlowResult(value, flows, node_flows)


def flow_value(topo: Topology, placement: Placement, partial: bool = True) -> float:
    """Just the max-flow value (the search's objective)."""
    return max_flow(topo, placement, partial).value


def _max_flow_networkx(topo, placement, nodes, edges) -> FlowResult:
    import networkx as nx

    g = nx.DiGraph()
    g.add_node("source")
    g.add_node("sink")
    for i in nodes:
        s, e = placement[i]
        thr = topo.nodes[i].throughput
        k = e - s
        g.add_edge(("in", i), ("out", i), capacity=thr[k] if k < len(thr) else 0.0)
    for u, v, c in edges:
        a = "source" if u == SOURCE_INDEX else ("out", u)
        b = "sink" if v == SINK_INDEX else ("in", v)
        g.add_edge(a, b, capacity=c)
    value, fd = nx.maximum_flow(g, "source", "sink", flow_func=nx.algorithms.flow.preflow_push)
    flows = {}
    for u, v, _c in edges:
        a = "source" if u == SOURCE_INDEX else ("out", u)
        b = "sink" if v == SINK_INDEX else ("in", v)
        f = fd[a][b]
        if f > _EPS:
            flows[(u, v)] = f
    node_flows = {i: fd[("in", i)][("out", i)] for i in nodes}
    return FlowResult(float(value), flows, node_flows)
