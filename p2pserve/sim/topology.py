"""The routing graph a placement induces: which node may follow which, running which layers.

Vertices are compute nodes plus the coordinator, which is both ``SOURCE`` (it sends prompts and
decode tokens in) and ``SINK`` (it receives sampled tokens). A node ``v`` may follow ``u`` when a
link joins them and ``v`` holds layer ``end_u`` (the first layer ``u`` does not run); ``v`` then
runs ``[end_u, end_v)`` — partial inference, as in Helix: a stage may start mid-range but always
runs to the end of the node's range. The source leads to nodes holding layer 0; nodes whose range
ends at the last layer lead to the sink.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2pserve.sim.batching import BatchCaps
from p2pserve.sim.request import Stage

SOURCE = -1
SINK = -2


@dataclass(frozen=True)
class LinkSpec:
    """A directed link: ``bandwidth`` in bytes/s (after the unit convention), ``latency`` in s."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class NodeSpec:
    """A compute node with its assigned layers and limits."""

    idx: int
    gpu: str
    start: int
    end: int
    kv_capacity: int  # token-layer KV entries the node can hold
    caps: BatchCaps
    group: int = 0  # nodes only connect within a group (separate-pipelines baseline)

    @property
    def layers(self) -> int:
        """Number of layers held."""
        return self.end - self.start


@dataclass(frozen=True)
class Edge:
    """A routing choice out of a vertex: go to ``dst`` and run ``stage`` there (None: sink)."""

    src: int
    dst: int
    stage: Stage | None


@dataclass
class Topology:
    """Nodes, links and the induced routing edges of one placement."""

    num_layers: int
    token_bytes: int
    activation_bytes: int
    nodes: dict[int, NodeSpec]
    links: dict[tuple[int, int], LinkSpec]
    out_edges: dict[int, list[Edge]] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        num_layers: int,
        token_bytes: int,
        activation_bytes: int,
        nodes: list[NodeSpec],
        links: dict[tuple[int, int], LinkSpec],
    ) -> "Topology":
        """Derive routing edges from node ranges and links (directed ``(u, v)`` keys)."""
        by_idx = {n.idx: n for n in nodes}
        topo = cls(num_layers, token_bytes, activation_bytes, by_idx, dict(links))
        out: dict[int, list[Edge]] = {SOURCE: []}
        for v in nodes:
            if v.start == 0 and (SOURCE, v.idx) in links:
                out[SOURCE].append(Edge(SOURCE, v.idx, Stage(v.idx, 0, v.end)))
        for u in nodes:
            edges = []
            if u.end == num_layers:
                if (u.idx, SINK) in links:
                    edges.append(Edge(u.idx, SINK, None))
            else:
                for v in nodes:
                    if (
                        v.idx != u.idx
                        and v.group == u.group
                        and v.start <= u.end < v.end
                        and (u.idx, v.idx) in links
                    ):
                        edges.append(Edge(u.idx, v.idx, Stage(v.idx, u.end, v.end)))
            out[u.idx] = edges
        topo.out_edges = out
        return topo

    def link(self, u: int, v: int) -> LinkSpec:
        """The directed link ``u -> v``."""
        return self.links[(u, v)]

    def edge_capacity(self, u: int, v: int) -> float:
        """Tokens/s the link ``u -> v`` carries: token ids at the ends, activations inside."""
        size = self.token_bytes if (u == SOURCE or v == SINK) else self.activation_bytes
        return self.links[(u, v)].bandwidth / size

    def covers_model(self) -> bool:
        """True when some source-to-sink path exists."""
        seen, stack = {SOURCE}, [SOURCE]
        while stack:
            u = stack.pop()
            for e in self.out_edges.get(u, ()):
                if e.dst == SINK:
                    return True
                if e.dst not in seen:
                    seen.add(e.dst)
                    stack.append(e.dst)
        return False
