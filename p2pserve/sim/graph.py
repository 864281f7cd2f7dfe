"""The routing graph a placement induces on a topology: which node may follow which, running what.

The hardware is the planner's :class:`~p2pserve.placement.topology.Topology` (nodes, directed
links, model sizes); what the simulator adds is each serving node's :class:`Assignment` (its
layer range and the limits it runs under there) and the edges those ranges induce.

Vertices are compute nodes plus the coordinator, which is both ``SOURCE_INDEX`` (it sends
prompts and decode tokens in) and ``SINK_INDEX`` (it receives sampled tokens). A node ``v`` may
follow ``u`` when a link joins them and ``v`` holds layer ``end_u`` (the first layer ``u`` does
not run); ``v`` then runs ``[end_u, end_v)`` -- partial inference, as in Helix: a stage may
start mid-range but always runs to the end of the node's range. The source leads to nodes
holding layer 0; nodes whose range ends at the last layer lead to the sink.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from p2pserve.placement.topology import Topology
from p2pserve.sim.batching import BatchCaps
from p2pserve.sim.request import Stage
from p2pserve.types import SINK_INDEX, SOURCE_INDEX


@dataclass(frozen=True)
class Assignment:
    """What a serving node runs in this simulation: layers ``[start, end)`` and its limits there."""

    start: int
    end: int
    kv_capacity: int  # token-layer KV entries the node can hold
    caps: BatchCaps

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
class StageGraph:
    """A topology, the assignments of its serving nodes, and the routing edges they induce."""

    topology: Topology
    assignments: dict[int, Assignment]
    out_edges: dict[int, list[Edge]] = field(default_factory=dict)

    @classmethod
    def build(cls, topology: Topology, assignments: Mapping[int, Assignment]) -> "StageGraph":
        """Derive routing edges from the assigned ranges and the topology's links."""
        nodes = dict(assignments)
        L = topology.num_layers
        out: dict[int, list[Edge]] = {SOURCE_INDEX: []}
        for v, a in nodes.items():
            if a.start == 0 and topology.link(SOURCE_INDEX, v) is not None:
                out[SOURCE_INDEX].append(Edge(SOURCE_INDEX, v, Stage(v, 0, a.end)))
        for u, au in nodes.items():
            edges = []
            if au.end == L:
                if topology.link(u, SINK_INDEX) is not None:
                    edges.append(Edge(u, SINK_INDEX, None))
            else:
                for v, av in nodes.items():
                    if v != u and av.start <= au.end < av.end and topology.link(u, v) is not None:
                        edges.append(Edge(u, v, Stage(v, au.end, av.end)))
            out[u] = edges
        return cls(topology, nodes, out)

    @property
    def num_layers(self) -> int:
        """Layers of the model."""
        return self.topology.num_layers

    @property
    def token_bytes(self) -> int:
        """Bytes of one token id (source and sink links carry these)."""
        return self.topology.token_bytes

    @property
    def activation_bytes(self) -> int:
        """Bytes of one token's activation (links between nodes carry these)."""
        return self.topology.activation_bytes

    def bytes_per_s(self, u: int, v: int) -> float:
        """Bytes per second of the link ``u -> v`` (the topology's bandwidth convention applied)."""
        return self.topology.bytes_per_s(u, v)

    def latency(self, u: int, v: int) -> float:
        """One-way latency of ``u -> v`` in seconds."""
        return self.topology.latency(u, v)

    def covers_model(self) -> bool:
        """True when some source-to-sink path exists."""
        seen, stack = {SOURCE_INDEX}, [SOURCE_INDEX]
        while stack:
            u = stack.pop()
            for e in self.out_edges.get(u, ()):
                if e.dst == SINK_INDEX:
                    return True
                if e.dst not in seen:
                    seen.add(e.dst)
                    stack.append(e.dst)
        return False
