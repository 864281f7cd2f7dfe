"""Churn handling: keep serving through joins and leaves with as few layer moves as possible.

* :func:`on_leave` -- nodes left. If the remaining placement still covers every layer, just
  recompute the max-flow on it (milliseconds, nothing reloads). Otherwise re-solve.
* :func:`resolve` -- warm-started search from the current placement where every layer a node
  must newly load costs ``reload_cost`` (tokens/s of objective per layer); only the nodes near
  the damage (new nodes, nodes whose neighbours vanished, plus a few random ones) are movable
  first, then everyone. One of its starts is exact: the placement that loads the fewest layers
  for the best start's flow (:func:`cover_start`, a MILP from :mod:`move_bound`).
* :func:`periodic` -- a fresh solve is adopted only if its gain beats the reload cost of moving
  to it.
* ``tolerance`` (of :func:`resolve`) -- once the search has found the best objective it can,
  spend the rest of the time on the placement that moves the fewest layers while keeping at
  least ``1 - tolerance`` of it (:func:`fewest_moves_within`). A price per layer cannot say
  "lose at most 3 %"; a tolerance can, and it is what an operator means.

Nodes are identified by *name* across topologies (indices shift when nodes leave).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping

from p2pserve.placement.maxflow import flow_value
from p2pserve.placement.move_bound import fewest_moves_for_flow, new_layer_count
from p2pserve.placement.planner import Plan, PlannerConfig, make_plan, plan_for_topology, throughput_score, validate_placement
from p2pserve.errors import PlanningError
from p2pserve.placement.search import balanced_chain, improve, max_flow_score
from p2pserve.placement.topology import SINK, SOURCE, Topology

NamedPlacement = dict[str, tuple[int, int]]


@dataclass(frozen=True)
class ChurnResult:
    """Outcome of a churn step: the new plan, layers loaded, whether it re-solved, and how soon
    a valid placement was available (a re-solve keeps improving it until its time limit)."""

    plan: Plan
    layers_moved: int
    resolved: bool
    elapsed_s: float
    first_valid_s: float | None = None  # when a valid (repaired / re-cut) placement existed


def by_name(topo: Topology, placement: Mapping[int, tuple[int, int]]) -> NamedPlacement:
    """Index placement -> name placement."""
    return {topo.nodes[i].name: r for i, r in placement.items()}


def by_index(topo: Topology, named: Mapping[str, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """Name placement -> index placement (names not in ``topo`` are dropped)."""
    idx = {n.name: i for i, n in enumerate(topo.nodes)}
    return {idx[name]: r for name, r in named.items() if name in idx}


def layers_to_load(old: Mapping[str, tuple[int, int]], new: Mapping[str, tuple[int, int]]) -> int:
    """Layers nodes must newly load to go from ``old`` to ``new`` (kept layers are free)."""
    return sum(new_layer_count(old.get(name), s, e) for name, (s, e) in new.items())


def _score_fn(topo: Topology, config: PlannerConfig):
    if config.objective == "max-flow":
        return max_flow_score(topo, config.partial)
    return throughput_score(topo, config)


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
    import networkx as nx

    groups = interchangeable_groups(topo)
    out: dict[int, tuple[int, int]] = {}
    for members in groups:
        ranges = [placement[i] for i in members if i in placement]
        if len(members) == 1 or not ranges:
            out.update({i: placement[i] for i in members if i in placement})
            continue
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
    and memory, and the same links to every other node, the source and the sink."""

    def link(a, b):
        spec = topo.link(a, b)
        return None if spec is None else (spec.bandwidth, spec.latency_s)

    def swappable(a: int, b: int) -> bool:
        if link(a, b) != link(b, a):
            return False
        return all(link(a, k) == link(b, k) and link(k, a) == link(k, b)
                   for k in [SOURCE, SINK, *range(topo.num_nodes)] if k not in (a, b))

    groups: list[list[int]] = []
    for i, node in enumerate(topo.nodes):
        kind = (node.gpu_type, tuple(node.throughput), node.memory_bytes, node.max_layers)
        for g in groups:
            first = topo.nodes[g[0]]
            if (first.gpu_type, tuple(first.throughput), first.memory_bytes, first.max_layers) == kind \
                    and swappable(g[0], i):
                g.append(i)
                break
        else:
            groups.append([i])
    return groups


def default_reload_cost(
    topo: Topology, current: Mapping[str, tuple[int, int]], config: PlannerConfig, fraction: float = 0.01
) -> float:
    """``fraction`` of the objective per layer, on the scale of the score ``config`` optimises.

    The two objectives have different units: max-flow scores tokens/s of flow, the throughput
    objective an estimate that is orders of magnitude smaller when peers announce no KV
    capacity (then only its 1e-4 x max-flow tie-break term is left). A reload cost taken from
    the max-flow bound would then outweigh any gain, and a swarm would keep its first
    placement forever. The scale is the current placement's score when it is valid, else the
    score of a single balanced pipeline, else the flow upper bound.
    """
    score = _score_fn(topo, config)
    scale = 0.0
    cur_idx = by_index(topo, current)
    if cur_idx and not validate_placement(topo, cur_idx):
        scale = score(cur_idx)
    if scale <= 0:
        chain = balanced_chain(topo)
        scale = score(chain) if chain else 0.0
    if scale <= 0:
        scale = topo.upper_bound()
    return fraction * scale / max(1, topo.num_layers)


def resolve(
    topo: Topology,
    current: Mapping[str, tuple[int, int]],
    config: PlannerConfig,
    reload_cost: float,
    time_limit_s: float,
    focus: list[int] | None = None,
    clock: Callable[[], float] = time.monotonic,
    fresh_share: float = 0.4,
    tolerance: float = 0.0,
    tolerance_share: float = 0.6,
    cover_share: float = 0.3,
) -> ChurnResult:
    """Warm-started re-solve charging ``reload_cost`` per newly loaded layer.

    Starts: the current placement, its repair, an order-keeping pipeline re-cut, and a fresh
    solve (``fresh_share`` of the time) relabelled onto the current nodes. Then a local search
    on flow minus reload cost: half of the remaining time moves only ``focus`` (new nodes,
    neighbours of departed ones), the rest moves everyone. With ``tolerance`` > 0, the last
    ``tolerance_share`` of the time goes to :func:`fewest_moves_within` the tolerance of the
    best objective found. Before the local search, up to ``cover_share`` of the time goes to
    the cover MILP (:func:`cover_start`): the placement that loads the fewest layers for the
    flow of the best start, which joins the starts.
    """
    t0 = clock()
    # The searches below overrun their limits by up to one evaluation, and the plan takes a
    # moment to build: stop them early enough that the whole re-solve keeps its time limit.
    time_limit_s = max(0.0, 0.97 * time_limit_s - 0.05)
    base = _score_fn(topo, config)
    cur_idx = by_index(topo, current)

    def score(p):
        return base(p) - reload_cost * layers_to_load(current, by_name(topo, p))

    starts = [cur_idx]
    if validate_placement(topo, cur_idx):
        # Uncovered layers: repair greedily first so the search starts from something valid.
        starts.append(_repair(topo, cur_idx))
    # Pipeline re-cuts that keep the current order: cheap, near-optimal for chain-like plans.
    order = _chain_order(topo, cur_idx)
    f0 = flow_value(topo, balanced_chain(topo), config.partial)
    floor = 0.8 * f0 if f0 > 0 else None
    newcomers = [i for i in range(topo.num_nodes) if i not in cur_idx]
    for i in newcomers:  # insert each newcomer where the re-cut scores best
        best_pos = None
        for pos in range(len(order) + 1):
            trial = order[:pos] + [i] + order[pos:]
            cut = chain_rebalance(topo, trial, cur_idx, reload_cost, floor)
            if cut is None:
                continue
            v = score(cut)
            if best_pos is None or v > best_pos[0]:
                best_pos = (v, pos)
        if best_pos is not None:
            order = order[: best_pos[1]] + [i] + order[best_pos[1]:]
    cut = chain_rebalance(topo, order, cur_idx, reload_cost, floor)
    if cut:
        starts.append(cut)
    valid = [p for p in starts if not validate_placement(topo, p)]
    first_valid = clock() - t0 if valid else None
    # A fresh solve that ignores the current placement, relabelled onto it: it may reach flows
    # the local moves below cannot, and relabelling makes it keep what it can.
    try:
        fresh = plan_for_topology(topo, replace(config, time_limit_s=fresh_share * time_limit_s), clock=clock)
        starts.append(relabel_for_fewest_moves(topo, fresh.assignments, current))
    except PlanningError:
        pass  # too little memory for a fresh cover; the repaired starts remain
    starts = [relabel_for_fewest_moves(topo, p, current) for p in starts]
    if first_valid is None and any(not validate_placement(topo, p) for p in starts):
        first_valid = clock() - t0
    if cover_share > 0:
        # Before the local search: the cover placement is a start that single moves rarely
        # reach (a stage jumping into the hole while faster nodes re-cut to fill its place).
        # It asks for the reference's whole flow even under a tolerance: HiGHS settles that
        # question in about half the time of a lower target (cluster24, remove 1: 1.6-2.0 s
        # against 2.1-5.8 s), and the tolerance phase may cut further from its answer.
        ref = max((p for p in starts if not validate_placement(topo, p)), key=score, default=None)
        if ref is not None:
            cover = cover_start(topo, current, ref, flow_value(topo, ref, config.partial),
                                min(cover_share * time_limit_s, time_limit_s - (clock() - t0)))
            if cover is not None:
                starts.append(cover)
    movable = focus if focus else None
    reserve = tolerance_share * time_limit_s if tolerance > 0 else 0.0
    left = time_limit_s - reserve - (clock() - t0)
    best, _ = improve(topo, starts, score, left * 0.5, seed=config.seed, movable=movable, clock=clock)
    left = time_limit_s - reserve - (clock() - t0)
    if left > 0:
        best, _ = improve(topo, [best], score, left, seed=config.seed + 7, clock=clock)
    if tolerance > 0:
        target = (1.0 - tolerance) * base(best)
        cuts = []
        if target > 0:
            # The order-keeping re-cut that loads fewest layers at a flow near the target: for
            # chain-like plans it is often the answer outright.
            best_flow = flow_value(topo, best, config.partial)
            flow_target = (1.0 - tolerance) * best_flow
            for floor in (flow_target, 0.5 * (flow_target + best_flow)):
                # A reload price far above any flow: the fewest moves at a flow >= floor.
                cut = chain_rebalance(topo, _chain_order(topo, cur_idx), cur_idx, 1e12, floor)
                if cut:
                    cuts.append(cut)
        best = fewest_moves_within(topo, current, base, target, [best, *starts, *cuts],
                                   time_limit_s - (clock() - t0), seed=config.seed + 13, clock=clock)
    plan = make_plan(topo, best, config, clock() - t0, "incremental")
    return ChurnResult(plan, layers_to_load(current, by_name(topo, best)), True, clock() - t0, first_valid)


def cover_start(
    topo: Topology,
    current: Mapping[str, tuple[int, int]],
    best: Mapping[int, tuple[int, int]],
    flow_target: float,
    time_limit_s: float,
) -> dict[int, tuple[int, int]] | None:
    """The placement loading the fewest layers whose layer cover reaches ``flow_target``.

    An exact MILP over every range each node could hold (:mod:`move_bound`), limited to fewer
    moves than ``best`` makes. Where links do not bind, a placement's max-flow usually equals
    its cover, and this finds repairs that single-node moves cannot reach: a lost stage is
    absorbed by re-cutting only the nodes that have throughput to spare. Its real flow can fall
    short of its cover, so callers use it as a start, never as the answer unchecked. None when
    no such placement moves fewer layers than ``best``, time is short, or it is invalid.
    """
    moved = layers_to_load(current, by_name(topo, best))
    if moved <= 0 or flow_target <= 0 or time_limit_s < 0.2:
        return None
    # ``best`` itself meets the MILP (its cover is at least its flow): it is the incumbent, and
    # a budget of its own moves keeps the model feasible, which HiGHS solves far faster than a
    # budget it must prove infeasible.
    res = fewest_moves_for_flow(topo, by_index(topo, current), flow_target, moved, time_limit_s, start=best)
    if res.placement is None or validate_placement(topo, res.placement):
        return None
    if layers_to_load(current, by_name(topo, res.placement)) >= moved:
        return None
    return res.placement


def fewest_moves_within(
    topo: Topology,
    current: Mapping[str, tuple[int, int]],
    value: Callable[[Mapping[int, tuple[int, int]]], float],
    target: float,
    starts: list[Mapping[int, tuple[int, int]]],
    time_limit_s: float,
    seed: int = 0,
    clock: Callable[[], float] = time.monotonic,
) -> dict[int, tuple[int, int]]:
    """The placement loading the fewest layers whose ``value`` is at least ``target``.

    Lexicographic: any valid placement reaching the target beats every one that does not; among
    those, fewer moved layers win. Each start first gets a greedy undo (give nodes back their
    current range, largest reload first, while the target holds); then rounds of annealing, on
    that score and on value minus a price per move, refine the best. Falls back to the start
    with the highest value when none reaches the target.
    """
    t0 = clock()
    big = float(topo.num_layers * max(1, topo.num_nodes) + 1)  # more than any reload
    cur_idx = by_index(topo, current)
    known: dict[tuple, float | None] = {}  # placement -> value (None: invalid); rounds revisit many

    def moves(p) -> int:
        return layers_to_load(current, by_name(topo, p))

    def valid_value(p) -> float | None:
        key = tuple(sorted(p.items()))
        if key not in known:
            known[key] = None if validate_placement(topo, p) else value(p)
        return known[key]

    def score(p) -> float:
        v = valid_value(p)
        if v is None:
            return -4 * big
        if v >= target:
            return -float(moves(p))
        return -big - big * (target - v) / max(abs(target), 1e-12)

    def priced_score(price: float) -> Callable[[Mapping[int, tuple[int, int]]], float]:
        def priced(p) -> float:
            v = valid_value(p)
            return -4 * big if v is None else v - price * moves(p)

        return priced

    def undo(p: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
        p = dict(p)
        improved = True
        while improved and clock() - t0 < time_limit_s:
            improved = False
            changed = sorted((i for i in p if cur_idx.get(i) != p[i]),
                             key=lambda i: -layers_to_load(current, {topo.nodes[i].name: p[i]}))
            for i in changed:
                q = dict(p)
                if i in cur_idx:
                    q[i] = cur_idx[i]
                else:
                    del q[i]  # a newcomer left idle loads nothing
                if score(q) > score(p):
                    p, improved = q, True
        return p

    feasible = [dict(p) for p in starts if p and score(p) > -big]
    if not feasible:
        return max((dict(p) for p in starts if p), key=score)
    best = max((undo(p) for p in feasible), key=score)
    # Priced rounds: annealing on value - price x moves is smooth where the lexicographic score
    # is a cliff. Each round climbs from two sides: down from the fewest-moves placement that
    # reaches the target, and up from the start that moves least (typically the current
    # placement, repaired), where a fresh solve's placement, relabelled, is often out of reach
    # of single moves. The price rises while the rounds find nothing cheaper, falls when they
    # overshoot the target.
    low = min((dict(p) for p in starts if p and valid_value(p) is not None), key=moves, default=None)
    slack = max(valid_value(best) - target, 0.01 * abs(target), 1e-12)
    price = slack / max(1, moves(best))  # dropping every move would cost exactly the slack
    rounds = 0
    while clock() - t0 < time_limit_s and moves(best) > 0:
        slice_s = min(time_limit_s - (clock() - t0), max(0.25, time_limit_s / 8))
        priced = priced_score(price)
        froms = [best] if low is None or moves(low) >= moves(best) else [best, low]
        # The lexicographic score itself, from the best so far: it keeps the target exactly.
        found = [improve(topo, [best], score, slice_s / 2, seed=seed + 3 * rounds, clock=clock)[0]]
        found += [undo(improve(topo, [f], priced, slice_s / 2 / len(froms), seed=seed + 3 * rounds + 1 + k,
                               clock=clock)[0]) for k, f in enumerate(froms)]
        rounds += 1
        cand = max(found, key=score)
        if score(cand) > score(best):
            best = cand  # keep the price: there may be more at it
        elif all((valid_value(c) or float("-inf")) < target for c in found[1:]):
            price *= 0.6  # overshot: the search traded too much value away
        else:
            price *= 2.0  # nothing cheaper was worth its value at this price
    return best


def new_layers(old, i: int, s: int, e: int) -> int:
    """Layers node ``i`` must newly load to hold ``[s, e)``, given ``old`` = {node: range held now}."""
    return new_layer_count(old.get(i), s, e) if e > s else 0


def chain_rebalance(
    topo: Topology,
    order: list[int],
    old: Mapping[int, tuple[int, int]],
    reload_cost: float,
    min_flow: float | None = None,
) -> dict[int, tuple[int, int]] | None:
    """Best re-cut of a pipeline whose node order is fixed, trading flow against reloads.

    For each candidate flow F (every distinct T value) a DP over (node position, boundary)
    finds the boundaries that keep every node at T_i(k_i) >= F (k_i = 0 means the node idles)
    while loading the fewest new layers; the best F - reload_cost * moved wins. O(F-values x
    n x L x K): milliseconds for 24 nodes and 80 layers. Link capacities are not modelled in
    the DP; callers evaluate the result with the real max-flow.
    """
    L = topo.num_layers
    n = len(order)
    if n == 0:
        return None
    values = sorted({t for i in order for t in topo.nodes[i].throughput[1:] if t > 0}, reverse=True)
    if min_flow is not None:
        values = [v for v in values if v >= min_flow]
    INF = float("inf")

    def moved(i: int, s: int, e: int) -> int:
        return new_layers(old, i, s, e)

    best = None
    for F in values:
        kmax = []
        for i in order:
            thr = topo.nodes[i].throughput
            k = 0
            for kk in range(1, len(thr)):
                if thr[kk] >= F:
                    k = kk
            kmax.append(min(k, L))
        if sum(kmax) < L:
            continue
        # dp[b] = fewest moved layers with the first j nodes covering [0, b)
        dp = [INF] * (L + 1)
        dp[0] = 0
        choice = []
        for j, i in enumerate(order):
            nxt = [INF] * (L + 1)
            ch = [None] * (L + 1)
            for b in range(L + 1):
                if dp[b] == INF:
                    continue
                # idle
                if dp[b] < nxt[b]:
                    nxt[b], ch[b] = dp[b], (b, b)
                for k in range(1, kmax[j] + 1):
                    e = b + k
                    if e > L:
                        break
                    c = dp[b] + moved(i, b, e)
                    if c < nxt[e]:
                        nxt[e], ch[e] = c, (b, e)
            choice.append(ch)
            dp = nxt
        if dp[L] == INF:
            continue
        score = F - reload_cost * dp[L]
        if best is None or score > best[0]:
            # backtrack
            out, b = {}, L
            for j in range(n - 1, -1, -1):
                s, e = choice[j][b]
                if e > s:
                    out[order[j]] = (s, e)
                b = s
            best = (score, out)
    return best[1] if best else None


def _chain_order(topo: Topology, placement: Mapping[int, tuple[int, int]]) -> list[int]:
    """Nodes ordered along the layer axis (by start, then end)."""
    return sorted(placement, key=lambda i: (placement[i][0], placement[i][1], i))


def _repair(topo: Topology, placement: Mapping[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
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


def on_leave(
    topo: Topology,
    current: Mapping[str, tuple[int, int]],
    config: PlannerConfig,
    reload_cost: float,
    time_limit_s: float = 10.0,
    clock: Callable[[], float] = time.monotonic,
    tolerance: float = 0.0,
) -> ChurnResult:
    """Nodes left (``topo`` no longer has them). Recompute flows only, if coverage holds."""
    t0 = clock()
    cur_idx = by_index(topo, current)
    if not validate_placement(topo, cur_idx) and flow_value(topo, cur_idx, config.partial) > 0:
        plan = make_plan(topo, cur_idx, config, clock() - t0, "flows-only")
        return ChurnResult(plan, 0, False, clock() - t0, clock() - t0)
    return resolve(topo, current, config, reload_cost, time_limit_s, clock=clock, tolerance=tolerance)


def on_join(
    topo: Topology,
    current: Mapping[str, tuple[int, int]],
    config: PlannerConfig,
    reload_cost: float,
    time_limit_s: float = 10.0,
    clock: Callable[[], float] = time.monotonic,
    tolerance: float = 0.0,
) -> ChurnResult:
    """New nodes joined: re-solve with the newcomers (and, later, everyone) movable."""
    new = [i for i, n in enumerate(topo.nodes) if n.name not in current]
    return resolve(topo, current, config, reload_cost, time_limit_s, focus=new or None, clock=clock,
                   tolerance=tolerance)


def periodic(
    topo: Topology,
    current: Mapping[str, tuple[int, int]],
    config: PlannerConfig,
    reload_cost: float,
    clock: Callable[[], float] = time.monotonic,
) -> ChurnResult:
    """Fresh solve; adopt it only if its objective gain beats the reload cost of moving."""
    t0 = clock()
    cur_idx = by_index(topo, current)
    score = _score_fn(topo, config)
    fresh = plan_for_topology(topo, config, current=cur_idx, clock=clock)
    relabelled = relabel_for_fewest_moves(topo, fresh.assignments, current)
    moved = layers_to_load(current, by_name(topo, relabelled))
    gain = score(relabelled) - (score(cur_idx) if not validate_placement(topo, cur_idx) else float("-inf"))
    if gain > reload_cost * moved:
        return ChurnResult(make_plan(topo, relabelled, config, clock() - t0, "periodic:adopted"), moved, True,
                           clock() - t0)
    plan = make_plan(topo, cur_idx, config, clock() - t0, "periodic:kept")
    return ChurnResult(plan, 0, False, clock() - t0)
