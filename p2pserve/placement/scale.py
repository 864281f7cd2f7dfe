"""The planner at swarm scale: regions, cells, one solve per distinct cell, stitched.

Measured on generated clusters (``benchmarks/scale.py``): one evaluation of a 256-node placement
costs 0.1-0.5 s (the max-flow graph has an edge for every pair of consecutive ranges, and Dinic's
search runs over all of them), so the search of :func:`planner.plan_for_topology` barely moves
there, and filling idle nodes one evaluation at a time ran past its time limit. Here:

1. :func:`regions.find_regions` groups nodes by their measured links (LAN-latency components;
   a group that cannot hold the model joins its best-connected neighbour);
2. :func:`cells.split_region` deals each region into cells of a few dozen nodes of the same mix;
3. each *distinct* cell (:func:`cells.cell_key`: same nodes, same links) is solved once by the
   full planner with a work budget, first briefly (a valid plan within seconds), then with the
   full budget while time allows; equal cells reuse the plan;
4. :mod:`stitch` unions the cell placements and sums their flows, each cell's scaled so that
   clients send it requests in proportion to what its KV cache holds.

Work grows with the number of cells (linear in the swarm) and the distinct ones with the
variety of hardware and links, not with the swarm's square. Small swarms (``direct_nodes`` or
fewer) go to the planner unchanged, so their plans are exactly today's.
:func:`replan_after_leave` repairs only the cells that lost nodes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Hashable, Mapping, Sequence

from p2pserve.placement.cells import CELL_NODES, cell_key, cell_topologies, split_region
from p2pserve.placement.guard import Check
from p2pserve.placement.planner import PlannerConfig, plan_for_topology
from p2pserve.placement.regions import LAN_LATENCY_S, find_regions
from p2pserve.placement.solution import Solution, check_memory
from p2pserve.placement.stitch import Flows, Placement, balance, stitched_solution, to_global
from p2pserve.placement.topology import Topology


@dataclass(frozen=True)
class ScaleConfig:
    """How :func:`plan_at_scale` decomposes and spends its work.

    ``direct_nodes``: at most this many nodes, the planner runs on the whole swarm as before.
    ``cell_nodes``: target nodes per cell. ``first_work`` / ``cell_work``: evaluations per
    distinct cell in the first (valid plan fast) and second (improving) pass. ``lan_latency_s``:
    the region threshold. ``time_limit_s``: outer wall-clock limit, with the planner's own
    ``time_limit_s`` if lower. The second pass is a deadline: it ends ``finish_share`` of the
    limit before it (stitching the cells estimates the whole swarm), and each distinct cell's
    search gets an equal share of what is left when its turn comes (a cell that finishes its work
    early leaves its time to the next), returning the best plan it found when its share runs
    out. On a machine fast enough for the work, the work ends every search and the same inputs
    give the same plan; ``stats["scale"]["stopped_by"]`` says ``time`` when the deadline cut one.
    ``min_cell_s``: a share below this is not worth starting a search for.
    """

    direct_nodes: int = 48
    cell_nodes: int = CELL_NODES
    first_work: int = 60
    cell_work: int = 1500
    lan_latency_s: float = LAN_LATENCY_S
    time_limit_s: float = 25.0
    finish_share: float = 0.1
    min_cell_s: float = 0.05


@dataclass
class _Cells:
    """The decomposition: cells (global indices), their topologies and keys, the distinct keys."""

    cells: list[list[int]]
    topos: list[Topology]
    keys: list[Hashable]
    regions: list[list[int]]
    cell_region: list[int]


def decompose(topo: Topology, scale: ScaleConfig) -> _Cells:
    """Regions, then cells, with each cell's topology and key."""
    regions = find_regions(topo, scale.lan_latency_s)
    split = [(x, c) for x, r in enumerate(regions) for c in split_region(topo, r, scale.cell_nodes)]
    cells = [c for _, c in split]
    topos = cell_topologies(topo, cells)
    return _Cells(cells, topos, [cell_key(t) for t in topos], regions, [x for x, _ in split])


def plan_at_scale(topo: Topology, config: PlannerConfig | None = None, scale: ScaleConfig = ScaleConfig(),
                  clock: Callable[[], float] = time.monotonic, check: Check | None = None) -> Solution:
    """A plan for ``topo`` (see module docstring); ``stats["scale"]`` says what was done.

    ``check`` (the publish guard) is used where the planner runs on the whole swarm (small
    swarms); decomposed plans are not checked (a simulation of the whole swarm is the cost this
    avoids).
    """
    config = config or PlannerConfig()
    t0 = clock()
    if topo.num_nodes <= scale.direct_nodes:
        return plan_for_topology(topo, config, clock=clock, check=check)
    check_memory(topo)
    dec = decompose(topo, scale)
    distinct = list(dict.fromkeys(dec.keys))
    first_of = {k: dec.keys.index(k) for k in distinct}
    plans: dict[Hashable, Solution] = {}
    for k in distinct:
        sub = dec.topos[first_of[k]]
        plans[k] = plan_for_topology(sub, replace(config, work=scale.first_work, time_limit_s=config.time_limit_s),
                                     clock=clock)
    first_valid = clock() - t0
    deadline = min(scale.time_limit_s, config.time_limit_s) * (1.0 - scale.finish_share)
    improved, stopped_by = 0, "work"
    for x, k in enumerate(distinct):
        share = cell_share(deadline - (clock() - t0), len(distinct) - x)
        if share < scale.min_cell_s:
            stopped_by = "time"
            break
        sub = dec.topos[first_of[k]]
        better = plan_for_topology(sub, replace(config, work=scale.cell_work,
                                                time_limit_s=search_limit(share, sub.num_nodes)),
                                   current=plans[k].assignments, clock=clock)
        if better.stats.get("search", {}).get("stopped_by") == "time":
            stopped_by = "time"
        if better.estimate.decode_tokens_per_s >= plans[k].estimate.decode_tokens_per_s:
            plans[k] = better
        improved += 1
    placement, flows = _union(dec, plans)
    stats = {"scale": {
        "regions": len(dec.regions), "region_sizes": [len(r) for r in dec.regions], "cells": len(dec.cells),
        "distinct_cells": len(distinct), "improved_cells": improved, "stopped_by": stopped_by,
        "first_valid_s": first_valid, "cell_names": [[topo.nodes[i].name for i in c] for c in dec.cells],
        "cell_regions": dec.cell_region,
    }}
    return stitched_solution(topo, placement, flows, config, clock() - t0, "scale(cells)", stats,
                             cells=dec.cells)


def cell_share(left_s: float, cells_left: int) -> float:
    """Seconds for the next of ``cells_left`` cell searches when ``left_s`` remain before the
    deadline: an equal share (0 once the deadline passed)."""
    return max(0.0, left_s) / max(1, cells_left)


def search_limit(share_s: float, nodes: int) -> float:
    """The time limit that gives a work-budgeted :func:`planner.plan_for_topology` about
    ``share_s`` seconds of search on ``nodes`` nodes: the throughput objective searches until
    95 % of its limit less 0.05 s per node (its margin for finishing a plan, far more than a
    cell of a few dozen nodes needs), so the limit is the share plus that margin."""
    return (share_s + 0.05 * nodes) / 0.95


def _union(dec: _Cells, plans: Mapping[Hashable, Solution]) -> tuple[Placement, Flows]:
    """Every cell's plan (by its key) in global indices, placements and flows merged."""
    placement: Placement = {}
    parts: list[Flows] = []
    for cell, key in zip(dec.cells, dec.keys):
        p, f = to_global(cell, plans[key].assignments, plans[key].flows)
        placement.update(p)
        parts.append(f)
    flows: Flows = {}
    for f in balance(parts, [plans[key].estimate.concurrency for key in dec.keys]):
        flows.update(f)
    return placement, flows


def cells_by_name(solution: Solution) -> list[list[str]]:
    """The cells a :func:`plan_at_scale` solution was made of, as node names (re-plans use them)."""
    return [list(c) for c in solution.stats.get("scale", {}).get("cell_names", [])]


def region_of_name(solution: Solution) -> dict[str, str]:
    """Node name -> its region's name (``r0``, ``r1``, ...) in a :func:`plan_at_scale` solution:
    the groups its plan is published in (:mod:`p2pserve.dht.plan_chunks`)."""
    st = solution.stats.get("scale", {})
    return {name: f"r{r}" for names, r in zip(st.get("cell_names", []), st.get("cell_regions", [])) for name in names}


def subset_by_names(topo: Topology, names: Sequence[str]) -> list[int]:
    """Indices in ``topo`` of ``names`` that are still there, in that order."""
    index = {n.name: i for i, n in enumerate(topo.nodes)}
    return [index[x] for x in names if x in index]
