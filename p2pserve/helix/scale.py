"""Generated clusters at swarm scale, built in memory instead of written as ``.ini`` text.

:func:`p2pserve.helix.generate.cluster_text` writes a complete graph: 1,000 peers make half a
million ``[Link-a-b]`` sections, which take minutes to parse and describe a swarm no peer could
measure. :func:`scale_cluster` builds the same regions as a
:class:`~p2pserve.helix.format.HelixCluster` directly and keeps what bounded probing measures:
every link inside a region (LAN), and from each node ``inter_sample`` links to nodes of other
regions (WAN), drawn by a seeded generator. ``inter_sample=None`` keeps every link, as
``cluster_text`` does.
"""

from __future__ import annotations

import random
from typing import Sequence

from p2pserve.helix.format import HelixCluster, HelixLink
from p2pserve.helix.generate import LAN, WAN, Net

Regions = Sequence[Sequence[tuple[str, int]]]


def _link(net: Net) -> HelixLink:
    """A link class as the file would read (``mbps`` numbers as the authors evaluate them)."""
    return HelixLink(bandwidth=net.mbps * 1e6, latency_s=net.ms * 1e-3)


def region_of(regions: Regions) -> tuple[list[str], list[int]]:
    """Node types and region index per node, in generation order (regions, then types)."""
    types: list[str] = []
    region: list[int] = []
    for r, members in enumerate(regions):
        for gpu, count in members:
            types += [gpu] * count
            region += [r] * count
    return types, region


def scale_cluster(regions: Regions, name: str, intra: Net = LAN, inter: Net = WAN,
                  inter_sample: int | None = 8, seed: int = 0) -> HelixCluster:
    """A cluster of ``regions`` with the coordinator in region 0 (see module docstring)."""
    types, region = region_of(regions)
    n = len(types)
    lan, wan = _link(intra), _link(inter)
    links: dict[tuple[int, int], HelixLink] = {}
    members: dict[int, list[int]] = {}
    for i, r in enumerate(region):
        members.setdefault(r, []).append(i)
    for group in members.values():
        for x, a in enumerate(group):
            for b in group[x + 1:]:
                links[(a, b)] = lan
    rng = random.Random(seed)
    for a in range(n):
        others = [j for j in range(n) if region[j] != region[a]]
        if inter_sample is not None and len(others) > inter_sample:
            others = rng.sample(others, inter_sample)
        for b in others:
            links[(min(a, b), max(a, b))] = wan
    everyone = list(range(n))
    ends = {i: (lan if region[i] == 0 else wan) for i in everyone}
    return HelixCluster(n, types, everyone, everyone, links, dict(ends), dict(ends), name=name)


def five_regions(total: int) -> list[list[tuple[str, int]]]:
    """``total`` peers in 5 regions of A100, V100, L4 and T4 (as even as the count allows)."""
    kinds = ("A100", "V100", "L4", "T4")
    out: list[list[tuple[str, int]]] = []
    for r in range(5):
        per_region = total // 5 + (1 if r < total % 5 else 0)
        out.append([(k, per_region // 4 + (1 if x < per_region % 4 else 0)) for x, k in enumerate(kinds)])
    return out
