"""Relabelling: swap ranges among interchangeable nodes so a new placement reloads least.

Two nodes are interchangeable when they have the same GPU type, throughput table and memory,
and the same links to every other node, the source and the sink: giving one's range to the
other changes no flow, only which layers must load.
"""

from __future__ import annotations

from typing import Mapping

from p2pserve.placement.topology import Topology
from p2pserve.types import SINK_INDEX, SOURCE_INDEX


def relabel_for_fewest_moves(
    topo: Topology, placement: Mapping[int, tuple[int, int]], current: Mapping[str, tuple[int, int]]
) -> dict[int, tuple[int, int]]:
    """The same placement with ranges swapped among interchangeable nodes to keep most layers.

    Nodes with the same GPU type, throughput table, memory and links are interchangeable: giving
    one's range to the other changes nothing but which layers must load. Per group of such
    nodes, a maximum-weight matching of nodes to the group's ranges (weight = layers the node
    already holds) picks the labelling that reloads least. A fresh solve knows nothing of the
    current placement; relabelled, it often keeps most of it.
    """
    import networkx as nx

    groups = interchangeable_groups(topo)
    out: dict[int, tuple[int, int]] = {}
    for members in groups:
        ranges = [placement[i] for i in members if i in placement]
        if len(members) == 1 or not ranges:
            out.update({i: placement[i] for i in members if i in placement})
            continue
        g = nx.Graph()
        for i in members:
            held = current.get(topo.nodes[i].name)
            for j, (s, e) in enumerate(ranges):
                kept = max(0, min(e, held[1]) - max(s, held[0])) if held else 0
                g.add_edge(("node", i), ("range", j), weight=kept + 1)  # +1: every range gets a node
        for a, b in nx.max_weight_matching(g, maxcardinality=True):
            node, rng = (a, b) if a[0] == "node" else (b, a)
            out[node[1]] = ranges[rng[1]]
    return out


def interchangeable_groups(topo: Topology) -> list[list[int]]:
    """Nodes that could swap places without changing any flow: same GPU type, throughput table
    and memory, and the same links to every other node, the source and the sink."""

    def link(a, b):
        spec = topo.link(a, b)
        return None if spec is None else (spec.bandwidth, spec.latency_s)

    def swappable(a: int, b: int) -> bool:
        if link(a, b) != link(b, a):
            return False
        return all(link(a, k) == link(b, k) and link(k, a) == link(k, b)
                   for k in [SOURCE_INDEX, SINK_INDEX, *range(topo.num_nodes)] if k not in (a, b))

    groups: list[list[int]] = []
    for i, node in enumerate(topo.nodes):
        kind = (node.gpu_type, tuple(node.throughput), node.memory_bytes, node.max_layers)
        for g in groups:
            first = topo.nodes[g[0]]
            if (first.gpu_type, tuple(first.throughput), first.memory_bytes, first.max_layers) == kind \
                    and swappable(g[0], i):
                g.append(i)
                break
        else:
            groups.append([i])
    return groups
