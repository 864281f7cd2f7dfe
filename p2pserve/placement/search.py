"""Placement search beyond the MILP: balanced chains and a large-neighbourhood search on max-flow.

Why: the Helix MILP's big-M linearisation has a very weak LP relaxation, so branch-and-bound on
a 2-core machine spends its minute proving little. Evaluating a placement exactly is cheap
(Dinic on ~50 vertices, well under a millisecond), so we search placements directly:

* :func:`balanced_chain` -- for a target flow F every node takes the most layers it can while
  keeping ``T_i(k) >= F``; a single pipeline through them carries F if the layers add up to L.
  Bisection on F gives the best single chain (2,045.6 on cluster24, versus Helix's 1,289.6).
* :func:`improve` -- simulated annealing over (start, #layers) per node with moves that resize,
  shift, re-target a node at the weakest layer, or swap two nodes' ranges; the score is any
  callable (max-flow, the depth/KV-aware throughput estimate, or either minus a reload cost).
  Moves are random but seeded, so a run is reproducible for a given evaluation budget.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from p2pserve.placement.heuristics import stack_spans
from p2pserve.placement.maxflow import flow_value
from p2pserve.placement.topology import Topology

PlacementDict = dict[int, tuple[int, int]]
Score = Callable[[PlacementDict], float]
#: Annealing restarts from the best placement after this many evaluations without improvement.
RESTART_AFTER = 3000


def layer_cover(topo: Topology, placement: Mapping[int, tuple[int, int]]) -> list[float]:
    """Per layer, the summed throughput of nodes holding it: a cut bound on the max-flow."""
    cover = [0.0] * topo.num_layers
    for i, (s, e) in placement.items():
        t = topo.nodes[i].throughput[e - s]
        for l in range(s, e):
            cover[l] += t
    return cover


def max_flow_score(topo: Topology, partial: bool = True) -> Score:
    """Max-flow plus a tiny tie-break on the weakest layer's cover, to climb plateaus."""

    def score(p: PlacementDict) -> float:
        f = flow_value(topo, p, partial)
        cover = layer_cover(topo, p)
        return f + 1e-4 * min(cover) if cover else f

    return score


def balanced_chain(topo: Topology, nodes: list[int] | None = None) -> PlacementDict:
    """Best single pipeline through ``nodes`` (default all) by bisection on the target flow.

    For a target F each node takes the most layers k with T(k) >= F; feasible when the ks sum to
    at least L. Nodes are ordered by type so that equal nodes are neighbours. Surplus layers are
    trimmed from the nodes with the most layers. Returns {} when even F -> 0 cannot cover L.
    """
    L = topo.num_layers
    nodes = list(range(topo.num_nodes)) if nodes is None else list(nodes)
    nodes.sort(key=lambda i: (topo.nodes[i].gpu_type, i))

    def ks_for(F: float) -> list[int]:
        out = []
        for i in nodes:
            thr = topo.nodes[i].throughput
            k = 0
            for kk in range(1, len(thr)):
                if thr[kk] >= F:
                    k = kk
            out.append(k)
        return out

    if sum(ks_for(0.0)) < L:
        return {}
    lo, hi = 0.0, max((max(topo.nodes[i].throughput) for i in nodes), default=0.0)
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(ks_for(mid)) >= L:
            lo = mid
        else:
            hi = mid
    ks = ks_for(lo)
    surplus = sum(ks) - L
    while surplus > 0:
        j = max(range(len(ks)), key=lambda x: ks[x])
        ks[j] -= 1
        surplus -= 1
    return stack_spans(nodes, ks)


def chain_over(topo: Topology, nodes: list[int], start: int, end: int) -> PlacementDict:
    """One pipeline through ``nodes`` (in the given order) covering [start, end), cut so that
    the slowest stage is as fast as possible (bisection on F, as :func:`balanced_chain`)."""
    span = end - start
    if span <= 0 or not nodes:
        return {}

    def ks_for(F: float) -> list[int]:
        out = []
        for i in nodes:
            thr = topo.nodes[i].throughput
            k = 0
            for kk in range(1, min(len(thr), span + 1)):
                if thr[kk] >= F:
                    k = kk
            out.append(k)
        return out

    if sum(ks_for(0.0)) < span:
        return {}
    lo, hi = 0.0, max(max(topo.nodes[i].throughput) for i in nodes)
    for _ in range(50):
        mid = (lo + hi) / 2
        if sum(ks_for(mid)) >= span:
            lo = mid
        else:
            hi = mid
    ks = ks_for(lo)
    surplus = sum(ks) - span
    while surplus > 0:
        j = max(range(len(ks)), key=lambda x: ks[x])
        ks[j] -= 1
        surplus -= 1
    return stack_spans(nodes, ks, start)


def tiered_candidates(topo: Topology, max_groups: int = 3) -> list[PlacementDict]:
    """Structured starts for the throughput objective: the fastest GPU type as one shallow
    chain over the first layers, every other node split into 1..``max_groups`` parallel
    pipelines over the rest.

    Why: decode latency is paid per layer on every hop, so the layers fast GPUs hold should be
    on every token's path; slow GPUs are better used side by side, which halves their batches
    and doubles the KV cache behind each of their layers.
    """
    L = topo.num_layers
    by_type: dict[str, list[int]] = {}
    for i, n in enumerate(topo.nodes):
        if n.max_layers > 0:
            by_type.setdefault(n.gpu_type, []).append(i)
    if len(by_type) < 2:
        return []
    # fastest type: highest one-layer throughput
    fast_type = max(by_type, key=lambda t: topo.nodes[by_type[t][0]].throughput[1])
    fast = by_type[fast_type]
    rest = [i for t, members in by_type.items() if t != fast_type for i in members]
    rest.sort(key=lambda i: (-topo.nodes[i].throughput[1], i))
    kmax = topo.nodes[fast[0]].max_layers
    out = []
    for per in range(max(1, kmax // 2), kmax + 1):
        head = min(L - 1, per * len(fast))
        chain = chain_over(topo, fast, 0, head)
        if not chain:
            continue
        for g in range(1, max_groups + 1):
            groups = [rest[x::g] for x in range(g)]
            # Reverse every other group so replicas' boundaries are staggered, not aligned
            # (aligned twins fragment convoys; see estimate.WorkloadModel.aligned_weight).
            groups = [grp if x % 2 == 0 else grp[::-1] for x, grp in enumerate(groups)]
            p = dict(chain)
            ok = True
            for grp in groups:
                part = chain_over(topo, grp, head, L)
                if not part:
                    ok = False
                    break
                p.update(part)
            if ok:
                out.append(p)
    return out


@dataclass
class SearchStats:
    """What a search did: evaluations, improvements, time to the best, best score."""

    evaluations: int = 0
    improvements: int = 0
    best_score: float = float("-inf")
    time_to_best_s: float = 0.0
    elapsed_s: float = 0.0
    stopped_by: str = ""  # "work", "time" or "target"; "" if there was nothing to anneal


def _weakest_layer(topo: Topology, p: PlacementDict) -> int:
    cover = layer_cover(topo, p)
    return min(range(len(cover)), key=lambda l: cover[l])


def _clip(s: int, k: int, L: int) -> tuple[int, int]:
    k = max(1, min(k, L))
    s = max(0, min(s, L - k))
    return s, s + k


def _neighbour(topo: Topology, p: PlacementDict, rng: random.Random, movable: list[int]) -> PlacementDict | None:
    """One random move; returns a new placement dict or None if the move does nothing.

    Move kinds by the draw ``rng.random()``: below 0.15 (or when node i is idle) re-place i over
    the weakest layer; below 0.45 resize; below 0.7 shift; below 0.85 move a boundary with the
    next node; else swap with another node.
    """
    L = topo.num_layers
    q = dict(p)
    i = rng.choice(movable)
    kmax = min(topo.nodes[i].max_layers, L)
    if kmax <= 0:
        return None
    cur = q.get(i)
    move = rng.random()
    if cur is None or move < 0.15:
        _replace(topo, q, i, kmax, rng)
        done = True
    elif move < 0.45:
        done = _resize(q, i, cur, kmax, L, rng)
    elif move < 0.7:
        s, e = cur
        q[i] = _clip(s + rng.choice((-3, -2, -1, 1, 2, 3)), e - s, L)
        done = True
    elif move < 0.85:
        done = _move_boundary(topo, q, i, cur, kmax, L, rng)
    else:
        done = _swap(topo, q, i, cur, kmax, L, rng, movable)
    if not done:
        return None
    q = {a: b for a, b in q.items() if b is not None}
    return q if q != p else None


def _replace(topo: Topology, q: PlacementDict, i: int, kmax: int, rng: random.Random) -> None:
    """(Re)place node i over the weakest layer with a random size."""
    w = _weakest_layer(topo, {j: r for j, r in q.items() if j != i}) if q else 0
    k = rng.randint(1, kmax)
    s = w - rng.randint(0, k - 1)
    q[i] = _clip(s, k, topo.num_layers)


def _resize(q: PlacementDict, i: int, cur: tuple[int, int], kmax: int, L: int, rng: random.Random) -> bool:
    """Grow or shrink node i by one or two layers, keeping its start or its end."""
    s, e = cur
    k = e - s
    nk = max(1, min(kmax, k + rng.choice((-2, -1, 1, 2))))
    if nk == k:
        return False
    if rng.random() < 0.5:
        q[i] = _clip(s, nk, L)  # keep the start
    else:
        q[i] = _clip(e - nk, nk, L)  # keep the end
    return True


def _move_boundary(topo: Topology, q: PlacementDict, i: int, cur: tuple[int, int], kmax: int, L: int,
                   rng: random.Random) -> bool:
    """Move the boundary between i and a node j that starts where i ends by one layer (keeps a
    chain contiguous while rebalancing it)."""
    s, e = cur
    nb = [j for j, r in q.items() if j != i and r[0] == e]
    if not nb:
        return False
    j = rng.choice(nb)
    sj, ej = q[j]
    kj_max = min(topo.nodes[j].max_layers, L)
    if rng.random() < 0.5:
        if e - s >= kmax or ej - sj <= 1:
            return False
        q[i], q[j] = (s, e + 1), (sj + 1, ej)
    else:
        if e - s <= 1 or ej - sj >= kj_max:
            return False
        q[i], q[j] = (s, e - 1), (sj - 1, ej)
    return True


def _swap(topo: Topology, q: PlacementDict, i: int, cur: tuple[int, int], kmax: int, L: int,
          rng: random.Random, movable: list[int]) -> bool:
    """Swap the ranges of i and another node, resizing to what each can hold."""
    j = rng.choice(movable)
    if j == i or j not in q:
        return False
    si, ei = cur
    sj, ej = q[j]
    ki = min(ej - sj, kmax)
    kj = min(ei - si, topo.nodes[j].max_layers)
    q[i] = _clip(sj, ki, L)
    q[j] = _clip(si, kj, L)
    return True


def improve(
    topo: Topology,
    starts: list[PlacementDict],
    score: Score,
    time_limit_s: float,
    seed: int = 0,
    target: float | None = None,
    movable: list[int] | None = None,
    max_evals: int | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[PlacementDict, SearchStats]:
    """Simulated annealing from the best of ``starts``; returns the best placement seen.

    Stops at ``time_limit_s``, after ``max_evals`` evaluations, or once ``score >= target``.
    ``movable`` restricts which nodes may change (the rest keep their ranges). Restarts from
    the best placement when no improvement happened for a while.
    """
    rng = random.Random(seed)
    t0 = clock()
    stats = SearchStats()
    movable = list(range(topo.num_nodes)) if movable is None else list(movable)
    best, best_s = None, float("-inf")
    for p in starts:
        if not p:
            continue
        v = score(p)
        stats.evaluations += 1
        if v > best_s:
            best, best_s = dict(p), v
    if best is not None and movable:
        best = _anneal(topo, best, best_s, score, _Budget(t0, time_limit_s, max_evals, target, clock), rng,
                       movable, stats)
    else:
        stats.best_score = best_s
    stats.elapsed_s = clock() - t0
    return (best or {}), stats


@dataclass(frozen=True)
class _Budget:
    """When an annealing run stops: time, evaluations or a target score."""

    t0: float
    time_limit_s: float
    max_evals: int | None
    target: float | None
    clock: Callable[[], float]


def _anneal(topo: Topology, best: PlacementDict, best_s: float, score: Score, budget: _Budget,
            rng: random.Random, movable: list[int], stats: SearchStats) -> PlacementDict:
    """The annealing loop of :func:`improve`: temperature falls quadratically with the time used;
    after ``RESTART_AFTER`` evaluations without improvement it restarts from the best."""
    cur, cur_s = dict(best), best_s
    temp0 = 0.02 * max(abs(best_s), 1.0)
    since = 0
    clock, t0, limit = budget.clock, budget.t0, budget.time_limit_s
    while True:
        now = clock() - t0
        stop = _stop_reason(budget, now, stats.evaluations, best_s)
        if stop:
            stats.stopped_by = stop
            break
        # The schedule follows the budget that ends the run: with an evaluation budget the
        # temperature depends on evaluations only, so the same seed gives the same walk however
        # busy the machine is (wall time then only guards, as an outer limit).
        if budget.max_evals:
            frac = stats.evaluations / budget.max_evals
        else:
            frac = now / limit if limit > 0 else 1.0
        temp = temp0 * (1.0 - frac) ** 2 + 1e-9
        cand = _neighbour(topo, cur, rng, movable)
        if cand is None:
            continue
        v = score(cand)
        stats.evaluations += 1
        if v >= cur_s or rng.random() < math.exp((v - cur_s) / temp):
            cur, cur_s = cand, v
        if v > best_s + 1e-9:
            best, best_s = dict(cand), v
            stats.improvements += 1
            stats.time_to_best_s = clock() - t0
            since = 0
        else:
            since += 1
        if since > RESTART_AFTER:
            cur, cur_s, since = dict(best), best_s, 0
    stats.best_score = best_s
    return best


def _stop_reason(budget: _Budget, now: float, evaluations: int, best_s: float) -> str:
    """Why the annealing stops now ("time", "work" or "target"), or "" to go on."""
    if budget.max_evals is not None and evaluations >= budget.max_evals:
        return "work"
    if now >= budget.time_limit_s:
        return "time"
    if budget.target is not None and best_s >= budget.target:
        return "target"
    return ""
