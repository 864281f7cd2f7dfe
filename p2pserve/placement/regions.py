"""Regions: groups of well-connected nodes, found from the measured links alone.

A token that crosses a wide-area link pays its latency once per hop, so at scale the planner
keeps pipelines inside groups of nodes that talk over fast links and plans each group on its own
(:mod:`p2pserve.placement.scale`). A region here is a connected component of the graph whose
edges are links of at most ``lan_latency_s`` one-way latency, measured in both directions or
either. A region that cannot hold the whole model on its own is merged into the region it is best
connected to (most links, then lowest mean latency), so every region can serve every layer.
"""

from __future__ import annotations

from p2pserve.placement.topology import Topology

#: One-way latency at or below which two nodes count as neighbours (a LAN or a metro link).
LAN_LATENCY_S = 0.01


class _Union:
    """Union-find over node indices (path halving, union by size)."""

    def __init__(self, n: int) -> None:
        self.parent = list(range(n))
        self.size = [1] * n

    def find(self, a: int) -> int:
        while self.parent[a] != a:
            self.parent[a] = self.parent[self.parent[a]]
            a = self.parent[a]
        return a

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        if self.size[ra] < self.size[rb]:
            ra, rb = rb, ra
        self.parent[rb] = ra
        self.size[ra] += self.size[rb]


def find_regions(topo: Topology, lan_latency_s: float = LAN_LATENCY_S) -> list[list[int]]:
    """Regions of ``topo`` (sorted lists of node indices, ordered by their smallest index).

    Groups that cannot hold ``num_layers`` on their own are merged into their best-connected
    neighbour, until each can (or one group is left).
    """
    n = topo.num_nodes
    uf = _Union(n)
    for link in topo.links:
        if 0 <= link.src < n and 0 <= link.dst < n and link.latency_s <= lan_latency_s:
            uf.union(link.src, link.dst)
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(uf.find(i), []).append(i)
    regions = sorted(groups.values(), key=lambda g: g[0])
    return _merge_small(topo, regions)


def _merge_small(topo: Topology, regions: list[list[int]]) -> list[list[int]]:
    """Merge each region that cannot hold the model into its best-connected neighbour."""
    L = topo.num_layers
    regions = [list(r) for r in regions]
    while len(regions) > 1:
        small = [x for x, r in enumerate(regions) if sum(topo.nodes[i].max_layers for i in r) < L]
        if not small:
            break
        x = min(small, key=lambda y: (len(regions[y]), regions[y][0]))
        y = _best_neighbour(topo, regions, x)
        regions[y] = sorted(regions[y] + regions[x])
        del regions[x]
    return sorted(regions, key=lambda g: g[0])


def _best_neighbour(topo: Topology, regions: list[list[int]], x: int) -> int:
    """The region other than ``x`` with the most links to it (ties: lower mean latency)."""
    where = {i: r for r, members in enumerate(regions) for i in members}
    count: dict[int, int] = {}
    latency: dict[int, float] = {}
    mine = set(regions[x])
    for link in topo.links:
        if link.src in mine and link.dst in where and where[link.dst] != x:
            r = where[link.dst]
            count[r] = count.get(r, 0) + 1
            latency[r] = latency.get(r, 0.0) + link.latency_s
    others = [r for r in range(len(regions)) if r != x]
    if not count:
        return min(others, key=lambda r: regions[r][0])
    return min(count, key=lambda r: (-count[r], latency[r] / count[r], regions[r][0]))
