"""Lanes: a placement seen as parallel pipelines of like nodes, and re-cuts that move few layers.

A throughput plan on a heterogeneous swarm is a few *lanes*: the A100s in one chain over the
first layers, the L4s and the T4s each in a pipeline over the rest (``search.tiered_candidates``).
When nodes leave or join, a hole in a lane can be absorbed by shifting the cuts of that lane,
and a lane that can no longer cover its span can hand layers to another lane (the A100 chain
extends, the T4 lane starts later): coordinated changes that annealing on single-node moves
finds only by luck. This module searches that neighbourhood exhaustively.

Use: an analysis tool (``benchmarks/planner.py --lane-check``) that says whether a churn
scenario can reach a target within a move budget by lane re-cuts; it is not part of
``churn.resolve``, because on cluster24 it never found fewer moves than ``resolve``
(which can move one node across a lane, a move this neighbourhood lacks; docs/planner.md,
"The strict budget").

* :func:`lanes_of` -- the lanes of a placement: one per group of interchangeable nodes, in layer
  order; nodes that hold nothing (newcomers) are listed apart.
* :func:`lane_cuts` -- for one lane, every span it may cover (its current span with one end
  moved by up to ``reach`` layers) and every throughput floor F: the cut of the span, nodes in
  order, each node holding at most the layers that keep ``T_i(k) >= F``, that loads the fewest
  new layers (a DP over boundaries, as ``churn.chain_rebalance``).
* :func:`cut_span` -- the DP: fewest-moves cut of ``[start, end)`` for every end at once.
* :func:`fewest_moves_recut` -- combinations of one cut per lane, enumerated by increasing
  total layers loaded; the first valid one whose value reaches the target is the fewest-moves
  placement of that neighbourhood (exact within it, if the time allows reaching it).
"""

from __future__ import annotations

import heapq
import time
from typing import Callable, Mapping

from p2pserve.placement.moves import new_layers
from p2pserve.placement.topology import Topology

Placement = dict[int, tuple[int, int]]
#: A lane's cut: (layers it loads, {node: range}) for the lane's nodes (absent = idle).
Cut = tuple[int, dict[int, tuple[int, int]]]


def lanes_of(
    topo: Topology, placement: Mapping[int, tuple[int, int]], groups: list[list[int]]
) -> tuple[list[list[int]], list[int]]:
    """Lanes (node lists ordered by start, then end) and idle nodes.

    One lane per group of interchangeable nodes that holds layers; ``groups`` is
    ``churn.interchangeable_groups(topo)``.
    """
    lanes, idle = [], []
    for g in groups:
        held = sorted((i for i in g if i in placement), key=lambda i: (placement[i][0], placement[i][1], i))
        idle += [i for i in g if i not in placement]
        if held:
            lanes.append(held)
    return lanes, sorted(idle)


def cut_span(
    topo: Topology, order: list[int], old: Mapping[int, tuple[int, int]], start: int, floor: float
) -> list[Cut | None]:
    """Fewest-moves cuts of ``[start, end)`` for every ``end`` (index ``end - start``).

    Nodes keep ``order``; node i holds 0 (idles) to ``k_i(floor)`` layers, where ``k_i(F)`` is
    the most layers with ``T_i(k) >= F``. ``None`` where no cut covers the span.
    """
    L = topo.num_layers
    span = L - start
    INF = float("inf")
    kmax = []
    for i in order:
        thr = topo.nodes[i].throughput
        k = 0
        for kk in range(1, min(len(thr), topo.nodes[i].max_layers + 1)):
            if thr[kk] >= floor:
                k = kk
        kmax.append(k)
    dp = [INF] * (span + 1)
    dp[0] = 0
    choices = []
    for j, i in enumerate(order):
        nxt = list(dp)  # idle
        ch: list[tuple[int, int] | None] = [None if dp[b] == INF else (b, b) for b in range(span + 1)]
        for b in range(span + 1):
            if dp[b] == INF:
                continue
            for k in range(1, kmax[j] + 1):
                e = b + k
                if e > span:
                    break
                c = dp[b] + new_layers(old, i, start + b, start + e)
                if c < nxt[e]:
                    nxt[e], ch[e] = c, (b, e)
        choices.append(ch)
        dp = nxt
    out: list[Cut | None] = []
    for end in range(span + 1):
        if dp[end] == INF or end == 0:
            out.append(None)
            continue
        part, b = {}, end
        for j in range(len(order) - 1, -1, -1):
            s, e = choices[j][b]
            if e > s:
                part[order[j]] = (start + s, start + e)
            b = s
        out.append((int(dp[end]), part))
    return out


def lane_cuts(
    topo: Topology,
    lane: list[int],
    old: Mapping[int, tuple[int, int]],
    current: Mapping[int, tuple[int, int]],
    reach: int = 8,
    newcomers: list[int] = (),
) -> list[Cut]:
    """Candidate cuts of one lane, fewest moves first (see module docstring).

    ``old``: what nodes hold now (moves are counted against it); ``current``: the lane's
    present ranges, which set its span. A lane starting at layer 0 keeps that start and moves
    its end; any other lane keeps its end and moves its start (by up to ``reach`` layers).
    ``newcomers`` of the lane's kind are tried at every position of the lane (orders multiply:
    :func:`fewest_moves_recut` passes at most two).
    """
    L = topo.num_layers
    s0 = min(current[i][0] for i in lane)
    e0 = max(current[i][1] for i in lane)
    floors = sorted({t for i in lane + list(newcomers) for t in topo.nodes[i].throughput[1:] if t > 0})
    floors = [0.0] + floors
    orders = [lane]
    for nc in newcomers:
        orders = [o[:p] + [nc] + o[p:] for o in orders for p in range(len(o) + 1)]
    seen: dict[tuple, int] = {}
    if s0 == 0:
        spans = [(0, e) for e in range(max(1, e0 - reach), min(L, e0 + reach) + 1)]
    else:
        spans = [(s, e0) for s in range(max(0, s0 - reach), min(e0 - 1, s0 + reach) + 1)]
    starts = sorted({s for s, _ in spans})
    ends = {s: {e for s2, e in spans if s2 == s} for s in starts}
    for order in orders:
        for F in floors:
            for s in starts:
                table = cut_span(topo, order, old, s, F)
                for e in ends[s]:
                    c = table[e - s]
                    if c is None:
                        continue
                    key = tuple(sorted(c[1].items()))
                    if key not in seen or c[0] < seen[key]:
                        seen[key] = c[0]
    return sorted(((m, dict(k)) for k, m in seen.items()), key=lambda c: c[0])


def fewest_moves_recut(
    topo: Topology,
    old: Mapping[int, tuple[int, int]],
    current: Mapping[int, tuple[int, int]],
    groups: list[list[int]],
    value: Callable[[Placement], float],
    target: float,
    time_limit_s: float,
    valid: Callable[[Placement], bool],
    reach: int = 8,
    donors: list[Mapping[int, tuple[int, int]]] = (),
    max_moves: int | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[Placement | None, dict]:
    """The combination of lane cuts loading fewest layers whose ``value`` reaches ``target``.

    ``current`` is a placement on ``topo`` (repaired or not; it sets the lanes and spans),
    ``old`` what nodes hold now (index form). Each group of interchangeable nodes is one lane;
    its options are its re-cuts (:func:`lane_cuts`), its part of ``current``, and its part of
    every placement in ``donors`` (e.g. a fresh solve relabelled: taking one lane from it and
    keeping the others is a move no single-node search makes). Combinations of one option per
    lane are visited by increasing total moves (a heap over the sorted per-lane lists), up to
    ``max_moves`` and the time limit. Returns (placement or None, stats). ``proven_below`` is
    the move count of the last combination visited: every combination loading fewer layers was
    visited and failed; when the search stopped at ``max_moves`` (not at the time limit), so did
    every one loading exactly that many.
    """
    t0 = clock()
    options = _lane_options(topo, old, current, groups, reach, donors)
    stats = {"evaluations": 0, "proven_below": 0, "combinations": 1}
    for o in options:
        stats["combinations"] *= len(o)
    if not options:
        return None, stats
    return _cheapest_combination(options, value, target, valid, max_moves, lambda: clock() - t0 < time_limit_s,
                                 stats), stats


def _lane_options(
    topo: Topology,
    old: Mapping[int, tuple[int, int]],
    current: Mapping[int, tuple[int, int]],
    groups: list[list[int]],
    reach: int,
    donors: list[Mapping[int, tuple[int, int]]],
) -> list[list[Cut]]:
    """Per group with any option: its options (current part, donors' parts, re-cuts), cheapest first."""
    lanes, idle = lanes_of(topo, current, groups)
    lane_by_group = {}
    for lane in lanes:
        for gi, g in enumerate(groups):
            if lane[0] in g:
                lane_by_group[gi] = lane
    options = []
    for gi, g in enumerate(groups):
        members = set(g)
        opts: dict[tuple, int] = {}

        def add(part: Mapping[int, tuple[int, int]]) -> None:
            key = tuple(sorted((i, tuple(r)) for i, r in part.items() if i in members))
            if key:
                opts[key] = sum(new_layers(old, i, s, e) for i, (s, e) in key)

        add(current)
        for d in donors:
            add(d)
        if gi in lane_by_group:
            new = [i for i in idle if i in members][:2]
            for m, part in lane_cuts(topo, lane_by_group[gi], old, current, reach, new):
                add(part)
        if opts:
            options.append(sorted(((m, dict(k)) for k, m in opts.items()), key=lambda c: c[0]))
    return options


def _cheapest_combination(
    options: list[list[Cut]],
    value: Callable[[Placement], float],
    target: float,
    valid: Callable[[Placement], bool],
    max_moves: int | None,
    in_time: Callable[[], bool],
    stats: dict,
) -> Placement | None:
    """Combinations of one option per lane by increasing total moves (a heap over the sorted
    lists); the first valid one reaching ``target``, or None. Updates ``stats``."""
    n = len(options)
    start = tuple([0] * n)
    heap = [(sum(o[0][0] for o in options), start)]
    pushed = {start}
    while heap and in_time():
        moves, idx = heapq.heappop(heap)
        if max_moves is not None and moves > max_moves:
            break
        stats["proven_below"] = moves  # every combination with fewer moves was visited
        p: Placement = {}
        for o, j in zip(options, idx):
            p.update(o[j][1])
        stats["evaluations"] += 1
        if valid(p) and value(p) >= target:
            return p
        for d in range(n):
            if idx[d] + 1 < len(options[d]):
                nxt = idx[:d] + (idx[d] + 1,) + idx[d + 1:]
                if nxt not in pushed:
                    pushed.add(nxt)
                    heapq.heappush(heap, (moves - options[d][idx[d]][0] + options[d][idx[d] + 1][0], nxt))
    return None
