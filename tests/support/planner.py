"""Random placement topologies for the planner tests (seeded, memoised)."""

from __future__ import annotations

import random

from p2pserve.placement.topology import LinkSpec, NodeSpec, Topology
from p2pserve.types import SINK_INDEX as SINK
from p2pserve.types import SOURCE_INDEX as SOURCE

_TOPOS: dict = {}


def random_topology(n: int, L: int, kmax: int, seed: int, identical: bool = False) -> Topology:
    """Memoised :func:`make_topology` (so brute-force results are shared between tests)."""
    key = (n, L, kmax, seed, identical)
    if key not in _TOPOS:
        _TOPOS[key] = make_topology(n, L, kmax, seed, identical)
    return _TOPOS[key]


def make_topology(n: int, L: int, kmax: int, seed: int, identical: bool = False) -> Topology:
    """n nodes, L layers, random decreasing T tables and random (sometimes missing) links."""
    rng = random.Random(seed)
    nodes = []
    proto = None
    for i in range(n):
        if identical and proto is not None:
            thr = proto
        else:
            base = rng.uniform(200, 2000)
            k = rng.randint(max(1, kmax - 1), kmax)  # enough memory for every layer
            thr = tuple([0.0] + [base / (j ** rng.uniform(0.8, 1.3)) for j in range(1, k + 1)])
            proto = thr
        nodes.append(NodeSpec(f"n{i}", "X" if identical else f"t{i}", thr))
    links = []
    for i in range(n):
        links.append(LinkSpec(SOURCE, i, 1e9, 1e-3))
        links.append(LinkSpec(i, SINK, 1e9, 1e-3))
        for j in range(n):
            if i == j:
                continue
            if identical:
                bw = 8e6
            else:
                if rng.random() < 0.15:
                    continue
                bw = rng.uniform(1e6, 4e7)  # 61-2441 activations/s at 16 KB: links matter
            links.append(LinkSpec(i, j, bw, 1e-3))
    return Topology(tuple(nodes), tuple(links), num_layers=L, activation_bytes=16384, token_bytes=2)
