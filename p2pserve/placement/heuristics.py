"""Baseline placements: Petals-style greedy, Swarm-style even split, separate pipelines per type.

They are the comparison points of the Helix paper and the warm starts of our search/MILP. Each
returns a placement ``{node index: (start, end)}``; nodes that get nothing are absent. None of
them guarantees full coverage when memory is short; callers validate.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from p2pserve.placement.topology import Topology
from p2pserve.types import LayerRange


def stack_spans(nodes, ks, start: int = 0) -> dict[int, LayerRange]:
    """Consecutive ranges from ``start``: node ``nodes[j]`` takes the next ``ks[j]`` layers
    (nodes with 0 take nothing)."""
    out, s = {}, start
    for i, k in zip(nodes, ks):
        if k > 0:
            out[i] = (s, s + k)
            s += k
    return out


def _best_k(thr: tuple[float, ...]) -> int:
    """Layer count maximising layer-passes per second k*T(k)."""
    return max(range(1, len(thr)), key=lambda k: k * thr[k])


def petals_greedy(topo: Topology, order: list[int] | None = None) -> dict[int, tuple[int, int]]:
    """Petals: each server (in join order) loads as many layers as fit, on the contiguous span
    whose weakest layer has the least throughput coverage so far (ties: the earliest span)."""
    return fill_weakest_windows(topo, {}, list(order) if order is not None else range(topo.num_nodes))


def swarm_even(topo: Topology) -> dict[int, tuple[int, int]]:
    """SWARM-style: cut the model into equal stages that every node can hold (the smallest
    max_layers), then assign nodes, strongest first, to the stage with the least throughput."""
    L = topo.num_layers
    nodes = [i for i in range(topo.num_nodes) if topo.nodes[i].max_layers > 0]
    if not nodes:
        return {}
    size = min(topo.nodes[i].max_layers for i in nodes)
    stages = [(s, min(L, s + size)) for s in range(0, L, size)]
    power = [0.0] * len(stages)
    out: dict[int, tuple[int, int]] = {}
    nodes.sort(key=lambda i: -topo.nodes[i].throughput[size])
    for i in nodes:
        # First make sure every stage has someone, then balance throughput.
        empty = [x for x in range(len(stages)) if power[x] == 0.0]
        st = empty[0] if empty else min(range(len(stages)), key=lambda x: power[x])
        s, e = stages[st]
        out[i] = (s, e)
        power[st] += topo.nodes[i].throughput[e - s]
    return out


def even_chain(topo: Topology, nodes: list[int]) -> dict[int, tuple[int, int]]:
    """Split [0, L) over ``nodes`` in proportion to their max_layers (one pipeline, no replicas)."""
    L = topo.num_layers
    caps = [topo.nodes[i].max_layers for i in nodes]
    total = sum(caps)
    if total < L or not nodes:
        return {}
    # Largest-remainder split so that sum == L and each share <= its cap.
    shares = [c * L / total for c in caps]
    ks = [max(1, int(x)) for x in shares]
    while sum(ks) < L:
        j = max(range(len(ks)), key=lambda x: (caps[x] - ks[x] > 0, shares[x] - ks[x]))
        ks[j] += 1
    while sum(ks) > L:
        j = max(range(len(ks)), key=lambda x: ks[x] - shares[x])
        ks[j] -= 1
    return stack_spans(nodes, ks)


def separate_pipelines(topo: Topology) -> dict[int, tuple[int, int]]:
    """Separate pipelines per GPU type: each pipeline is the fewest nodes of one type that hold
    the whole model, layers split in proportion to memory. Nodes of a type too small to form a
    pipeline on its own (e.g. 12 T4s cannot hold LLaMA-2-70B in 16 GB each) are pooled, by type,
    into mixed pipelines; whatever is left replicates the stages of the last pipeline formed."""
    by_type: dict[str, list[int]] = {}
    for i, n in enumerate(topo.nodes):
        if n.max_layers > 0:
            by_type.setdefault(n.gpu_type, []).append(i)
    L = topo.num_layers
    out: dict[int, tuple[int, int]] = {}
    pool: list[int] = []
    for members in by_type.values():
        cap = topo.nodes[members[0]].max_layers
        per = -(-L // cap)
        npipes = len(members) // per
        for p in range(npipes):
            out.update(even_chain(topo, members[p * per : (p + 1) * per]))
        pool.extend(members[npipes * per :])
    current: list[int] = []
    last: dict[int, tuple[int, int]] = {}
    for i in pool:
        current.append(i)
        if sum(topo.nodes[j].max_layers for j in current) >= L:
            last = even_chain(topo, current)
            out.update(last)
            current = []
    # Leftovers replicate stages of the last mixed pipeline (never exceeding their memory).
    for i in current:
        best = None
        for s, e in last.values():
            if e - s <= topo.nodes[i].max_layers and (best is None or e - s > best[1] - best[0]):
                best = (s, e)
        if best is not None:
            out[i] = best
    return out


def best_k_chains(topo: Topology) -> dict[int, tuple[int, int]]:
    """All nodes in one chain ordered by type, each holding about its share of the layers so
    that per-node throughputs are balanced (a quick high-max-flow start for the search)."""
    order = sorted(range(topo.num_nodes), key=lambda i: topo.nodes[i].gpu_type)
    return even_chain(topo, order)


def all_heuristics(topo: Topology) -> dict[str, dict[int, tuple[int, int]]]:
    """Every baseline by name (used as warm starts and in the benchmark)."""
    return {
        "petals": petals_greedy(topo),
        "swarm": swarm_even(topo),
        "separate": separate_pipelines(topo),
        "chain": best_k_chains(topo),
    }


def coverage(L: int, spans) -> list[int]:
    """How many of ``spans`` hold each of the ``L`` layers."""
    cover = [0] * L
    for s, e in spans:
        for layer in range(s, e):
            cover[layer] += 1
    return cover


def fill_weakest_windows(topo: Topology, placed: Mapping[int, LayerRange], todo: Sequence[int]) -> dict[int, LayerRange]:
    """Keep ``placed``; give each node in ``todo`` the window of its ``max_layers`` layers whose
    weakest layer has the least throughput so far (ties: least total, then lowest start)."""
    L = topo.num_layers
    out = dict(placed)
    cover = [0.0] * L
    for i, (s, e) in out.items():
        t = topo.nodes[i].throughput
        for layer in range(s, e):
            cover[layer] += t[e - s] if e - s < len(t) else 0.0
    for i in todo:
        k = min(topo.nodes[i].max_layers, L)
        if k <= 0:
            continue
        best = min(range(L - k + 1), key=lambda s: (min(cover[s : s + k]), sum(cover[s : s + k]), s))
        out[i] = (best, best + k)
        for layer in range(best, best + k):
            cover[layer] += topo.nodes[i].throughput[k]
    return out
