"""Re-cuts: keep a pipeline's node order and move its boundaries, loading as few layers as possible.

* :func:`chain_rebalance` -- the best re-cut of a fixed node order, trading flow against reloads;
* :func:`chain_order` -- a placement's nodes along the layer axis (the order to re-cut);
* :func:`repair` -- cover layers nobody holds: idle nodes first, then stretch neighbours.

Link capacities are not modelled here; callers evaluate the result with the real max-flow.
"""

from __future__ import annotations

from typing import Mapping

from p2pserve.placement.moves import new_layers
from p2pserve.placement.topology import Topology

_INF = float("inf")


def chain_rebalance(
    topo: Topology,
    order: list[int],
    old: Mapping[int, tuple[int, int]],
    reload_cost: float,
    min_flow: float | None = None,
) -> dict[int, tuple[int, int]] | None:
    """Best re-cut of a pipeline whose node order is fixed, trading flow against reloads.

    For each candidate flow F (every distinct T value, at least ``min_flow``) a DP over (node
    position, boundary) finds the boundaries that keep every node at T_i(k_i) >= F (k_i = 0
    means the node idles) while loading the fewest new layers; the best F - reload_cost * moved
    wins. O(F-values x n x L x K): milliseconds for 24 nodes and 80 layers.
    """
    if not order:
        return None
    values = sorted({t for i in order for t in topo.nodes[i].throughput[1:] if t > 0}, reverse=True)
    if min_flow is not None:
        values = [v for v in values if v >= min_flow]
    best = None
    for F in values:
        kmax = _layers_at_flow(topo, order, F)
        if sum(kmax) < topo.num_layers:
            continue
        cut = _fewest_moves_cut(topo.num_layers, order, kmax, old)
        if cut is None:
            continue
        moved, out = cut
        score = F - reload_cost * moved
        if best is None or score > best[0]:
            best = (score, out)
    return best[1] if best else None


def _layers_at_flow(topo: Topology, order: list[int], F: float) -> list[int]:
    """Per node of ``order``, the most layers it can hold (at most L) while ``T_i(k) >= F``."""
    out = []
    for i in order:
        thr = topo.nodes[i].throughput
        k = 0
        for kk in range(1, len(thr)):
            if thr[kk] >= F:
                k = kk
        out.append(min(k, topo.num_layers))
    return out


def _fewest_moves_cut(
    L: int, order: list[int], kmax: list[int], old: Mapping[int, tuple[int, int]]
) -> tuple[float, dict[int, tuple[int, int]]] | None:
    """The cut of ``[0, L)`` over ``order`` (node j holding at most ``kmax[j]`` layers, or
    none) that loads the fewest new layers: (layers loaded, placement), or None if none covers."""
    # dp[b] = fewest moved layers with the first j nodes covering [0, b)
    dp = [_INF] * (L + 1)
    dp[0] = 0
    choice = []
    for j, i in enumerate(order):
        nxt = [_INF] * (L + 1)
        ch: list[tuple[int, int] | None] = [None] * (L + 1)
        for b in range(L + 1):
            if dp[b] == _INF:
                continue
            if dp[b] < nxt[b]:  # node i idles
                nxt[b], ch[b] = dp[b], (b, b)
            for k in range(1, kmax[j] + 1):
                e = b + k
                if e > L:
                    break
                c = dp[b] + new_layers(old, i, b, e)
                if c < nxt[e]:
                    nxt[e], ch[e] = c, (b, e)
        choice.append(ch)
        dp = nxt
    if dp[L] == _INF:
        return None
    out, b = {}, L
    for j in range(len(order) - 1, -1, -1):
        s, e = choice[j][b]
        if e > s:
            out[order[j]] = (s, e)
        b = s
    return dp[L], out


def chain_order(placement: Mapping[int, tuple[int, int]]) -> list[int]:
    """Nodes ordered along the layer axis (by start, then end)."""
    return sorted(placement, key=lambda i: (placement[i][0], placement[i][1], i))


def repair(topo: Topology, placement: Mapping[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """Cover missing layers: idle nodes first, then stretch neighbours, then move the weakest."""
    out = dict(placement)
    L = topo.num_layers
    for _ in range(L):
        covered = [False] * L
        for s, e in out.values():
            for l in range(s, e):
                covered[l] = True
        missing = [l for l in range(L) if not covered[l]]
        if not missing:
            break
        l0 = missing[0]
        run_end = l0
        while run_end < L and not covered[run_end]:
            run_end += 1
        gap = run_end - l0
        # Candidate nodes: idle ones, else those whose range touches the gap and can grow.
        best = None
        for i in range(topo.num_nodes):
            kmax = topo.nodes[i].max_layers
            if i not in out:
                k = min(kmax, gap)
                cand = (l0, l0 + k)
                key = (0, -k)
            else:
                s, e = out[i]
                if e == l0 and e - s < kmax:
                    cand = (s, min(e + gap, s + kmax))
                    key = (1, -(cand[1] - e))
                elif s == run_end and e - s < kmax:
                    cand = (max(s - gap, e - kmax), e)
                    key = (1, -(s - cand[0]))
                else:
                    continue
            if best is None or key < best[0]:
                best = (key, i, cand)
        if best is None:
            # Move the node with the most layers held by others too (a replica) onto the gap.
            i = max(out, key=lambda j: topo.nodes[j].max_layers)
            k = min(topo.nodes[i].max_layers, gap)
            out[i] = (l0, l0 + k)
        else:
            out[best[1]] = best[2]
    return out
