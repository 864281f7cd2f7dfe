"""Cells: a region cut into groups of a few dozen nodes with the same mix of hardware.

The planner's evaluation (a max-flow over every pair of consecutive ranges, then the decode
estimate) grows with the square of the nodes it places, and its search needs thousands of them.
A cell is small enough for the full planner and large enough to hold the structures it finds on
cluster24 (a fast chain over the first layers feeding parallel pipelines of slower GPUs). A
region's nodes, sorted by speed, are dealt round-robin into cells, so cells of one region get the
same mix; :func:`cell_key` names a cell's planning problem, and cells with equal keys get the same
plan (solved once).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Hashable, Sequence

from p2pserve.placement.topology import LinkSpec, NodeSpec, Topology
from p2pserve.types import SINK_INDEX, SOURCE_INDEX

#: Target nodes per cell: the size the planner's search handles at thousands of evaluations/s.
CELL_NODES = 24


def split_region(topo: Topology, region: Sequence[int], cell_nodes: int = CELL_NODES) -> list[list[int]]:
    """``region`` dealt into cells of at least ``cell_nodes`` nodes (fewer cells when one could not
    hold the whole model); a region smaller than two cells is one cell."""
    order = sorted(region, key=lambda i: (-_speed(topo.nodes[i]), topo.nodes[i].gpu_type, i))
    L = topo.num_layers
    count = max(1, len(order) // max(1, cell_nodes))
    while count > 1:
        cells = [order[x::count] for x in range(count)]
        if all(sum(topo.nodes[i].max_layers for i in c) >= L for c in cells):
            return cells
        count -= 1
    return [order]


def _speed(node: NodeSpec) -> float:
    """One layer's tokens/s (0 for a node that holds nothing)."""
    return node.throughput[1] if node.max_layers > 0 else 0.0


def cell_topologies(topo: Topology, cells: Sequence[Sequence[int]]) -> list[Topology]:
    """One topology per cell (node ``x`` of cell ``c`` is ``cells[c][x]``), its links and the
    source/sink's, found in one pass over ``topo.links`` (not one per cell)."""
    where: dict[int, tuple[int, int]] = {}
    for c, members in enumerate(cells):
        for x, i in enumerate(members):
            where[i] = (c, x)
    links: list[list[LinkSpec]] = [[] for _ in cells]
    for link in topo.links:
        a, b = where.get(link.src), where.get(link.dst)
        if link.src == SOURCE_INDEX and b is not None:
            links[b[0]].append(LinkSpec(SOURCE_INDEX, b[1], link.bandwidth, link.latency_s))
        elif link.dst == SINK_INDEX and a is not None:
            links[a[0]].append(LinkSpec(a[1], SINK_INDEX, link.bandwidth, link.latency_s))
        elif a is not None and b is not None and a[0] == b[0]:
            links[a[0]].append(LinkSpec(a[1], b[1], link.bandwidth, link.latency_s))
    return [
        Topology(nodes=tuple(topo.nodes[i] for i in members), links=tuple(ls), num_layers=topo.num_layers,
                 activation_bytes=topo.activation_bytes, token_bytes=topo.token_bytes,
                 convention=topo.convention, layer_bytes=topo.layer_bytes, model=topo.model,
                 name=f"{topo.name}/cell{c}")
        for c, (members, ls) in enumerate(zip(cells, links))
    ]


def cell_key(cell: Topology) -> Hashable:
    """What the cell's plan depends on: its nodes (without names) in order and every link's
    bandwidth and latency. Equal keys: the same planning problem, so the same plan."""
    nodes = tuple(replace(n, name="") for n in cell.nodes)
    links = tuple(sorted((l.src, l.dst, l.bandwidth, l.latency_s) for l in cell.links))
    return (nodes, links, cell.num_layers, cell.activation_bytes, cell.token_bytes, cell.convention)
