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
    groups = interchangeable_groups(topo)
    out: dict[int, tuple[int, int]] = {}
    for members in groups:
        ranges = [placement[i] for i in members if i in placement]
        if len(members) == 1 or not ranges:
            out.update({i: placement[i] for i in members if i in placement})
            continue
        import networkx as nx  # only where a group has several nodes (none in a sparse swarm: its import costs)

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
    and memory, and the same links to every other node, the source and the sink.

    Groups in the order of their first node, nodes in index order. Only nodes with the same kind
    and the same multisets of outgoing and incoming links (bandwidth, latency) are compared (a
    necessary condition: swapping keeps every link but the pair's own, which must match), and a
    comparison looks at the two nodes' neighbours only, not at every node: at a thousand peers
    with sampled links between regions (where hardly any two nodes are interchangeable) the
    pairwise scan over every node took seconds.
    """
    out: dict[int, dict[int, tuple[float, float]]] = {}
    into: dict[int, dict[int, tuple[float, float]]] = {}
    for link in topo.links:
        if link.src != link.dst:
            out.setdefault(link.src, {})[link.dst] = (link.bandwidth, link.latency_s)
            into.setdefault(link.dst, {})[link.src] = (link.bandwidth, link.latency_s)
    none: dict[int, tuple[float, float]] = {}

    def same(x: dict[int, tuple[float, float]], y: dict[int, tuple[float, float]], a: int, b: int) -> bool:
        return all(x.get(k) == y.get(k) for k in (x.keys() | y.keys()) - {a, b})

    def swappable(a: int, b: int) -> bool:
        oa, ob, ia, ib = out.get(a, none), out.get(b, none), into.get(a, none), into.get(b, none)
        return oa.get(b) == ob.get(a) and same(oa, ob, a, b) and same(ia, ib, a, b)

    def key(i: int) -> tuple:
        node = topo.nodes[i]
        return (node.gpu_type, tuple(node.throughput), node.memory_bytes, node.max_layers,
                tuple(sorted(out.get(i, none).values())), tuple(sorted(into.get(i, none).values())))

    groups: list[list[int]] = []
    by_key: dict[tuple, list[list[int]]] = {}
    for i in range(topo.num_nodes):
        candidates = by_key.setdefault(key(i), [])
        for g in candidates:
            if swappable(g[0], i):
                g.append(i)
                break
        else:
            groups.append([i])
            candidates.append(groups[-1])
    return groups
