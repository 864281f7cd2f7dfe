"""Churn handling: keep serving through joins and leaves with as few layer moves as possible.

* :func:`on_leave` -- nodes left. If the remaining placement still covers every layer, just
  recompute the max-flow on it (milliseconds, nothing reloads). Otherwise re-solve.
* :func:`resolve` -- warm-started search from the current placement where every layer a node
  must newly load costs ``reload_cost`` (tokens/s of objective per layer); only the nodes near
  the damage (new nodes, nodes whose neighbours vanished, plus a few random ones) are movable
  first, then everyone. One of its starts is exact: the placement that loads the fewest layers
  for the best start's flow (:func:`~p2pserve.placement.fewest_moves.cover_start`).
* :func:`periodic` -- a fresh solve is adopted only if its gain beats the reload cost of moving
  to it.
* ``tolerance`` (of :func:`resolve`) -- once the search has found the best objective it can,
  spend the rest of the time on the placement that moves the fewest layers while keeping at
  least ``1 - tolerance`` of it (:func:`~p2pserve.placement.fewest_moves.fewest_moves_within`).

How :func:`resolve` splits its time and seeds its searches is :class:`ChurnConfig`. Nodes are
identified by *name* across topologies (indices shift when nodes leave; :mod:`moves`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping

from p2pserve.errors import PlanningError
from p2pserve.placement.fewest_moves import cover_start, fewest_moves_within
from p2pserve.placement.maxflow import flow_value
from p2pserve.placement.moves import NamedPlacement, by_index, by_name, layers_to_load
from p2pserve.placement.planner import PlannerConfig, make_solution, plan_for_topology, throughput_score
from p2pserve.placement.recut import chain_order, chain_rebalance, repair
from p2pserve.placement.relabel import relabel_for_fewest_moves
from p2pserve.placement.search import balanced_chain, improve, max_flow_score
from p2pserve.placement.solution import Solution, validate_placement
from p2pserve.placement.topology import Topology

Placement = dict[int, tuple[int, int]]
__all__ = ["ChurnConfig", "ChurnResult", "NamedPlacement", "default_reload_cost", "layers_to_load", "on_join",
           "on_leave", "periodic", "resolve"]


@dataclass(frozen=True)
class ChurnConfig:
    """How :func:`resolve` spends its time and seeds its searches (defaults: the tuned values).

    Time, as shares of the (shrunk) time limit:

    * ``time_share`` / ``time_reserve_s``: the limit is first shrunk to ``time_share * limit -
      time_reserve_s``: the searches overrun their limits by up to one evaluation, and building
      the solution takes a moment, so they stop early enough that the whole re-solve keeps it;
    * ``fresh_share``: a fresh solve that ignores the current placement (then relabelled onto
      it), which may reach flows local moves cannot;
    * ``cover_share``: at most this for the cover MILP start (0: no cover start);
    * ``focus_share``: of the search time left, this share moves only the focus nodes (new
      nodes, neighbours of departed ones); the rest moves everyone;
    * ``tolerance_share``: with a tolerance, the last share goes to the fewest-moves phase.

    Re-cuts (order-keeping pipeline re-cuts, :func:`~p2pserve.placement.recut.chain_rebalance`):

    * ``recut_floor``: a re-cut start keeps at least this share of the balanced chain's flow;
    * ``recut_price``: a reload price far above any flow, so the tolerance phase's re-cuts are
      the fewest moves at a flow of at least their floor;
    * ``tolerance_recut_steps``: those floors, as steps from the tolerance's flow target (0) to
      the best flow found (1).

    Seeds: the everyone-moves search runs with ``seed + global_seed_offset``, the fewest-moves
    phase with ``seed + tolerance_seed_offset`` (distinct streams from the focus search's).
    """

    time_share: float = 0.97
    time_reserve_s: float = 0.05
    fresh_share: float = 0.4
    cover_share: float = 0.3
    focus_share: float = 0.5
    tolerance_share: float = 0.6
    recut_floor: float = 0.8
    recut_price: float = 1e12
    tolerance_recut_steps: tuple[float, ...] = (0.0, 0.5)
    global_seed_offset: int = 7
    tolerance_seed_offset: int = 13


@dataclass(frozen=True)
class ChurnResult:
    """Outcome of a churn step: the new solution, layers loaded, whether it re-solved, and how
    soon a valid placement was available (a re-solve keeps improving it until its time limit)."""

    plan: Solution
    layers_moved: int
    resolved: bool
    elapsed_s: float
    first_valid_s: float | None = None  # when a valid (repaired / re-cut) placement existed


def _score_fn(topo: Topology, config: PlannerConfig):
    if config.objective == "max-flow":
        return max_flow_score(topo, config.partial)
    return throughput_score(topo, config)


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
    tolerance: float = 0.0,
    churn: ChurnConfig = ChurnConfig(),
) -> ChurnResult:
    """Warm-started re-solve charging ``reload_cost`` per newly loaded layer.

    Starts: the current placement, its repair, an order-keeping pipeline re-cut, and a fresh
    solve relabelled onto the current nodes; then the cover MILP's placement for the best
    start's flow (:func:`cover_start`). Then a local search on the objective minus reload cost:
    first moving only ``focus`` (new nodes, neighbours of departed ones), then everyone. With
    ``tolerance`` > 0, the last part of the time goes to :func:`fewest_moves_within` the
    tolerance of the best objective found. ``churn`` says how the time is split.
    """
    t0 = clock()
    time_limit_s = max(0.0, churn.time_share * time_limit_s - churn.time_reserve_s)
    base = _score_fn(topo, config)
    cur_idx = by_index(topo, current)

    def score(p):
        return base(p) - reload_cost * layers_to_load(current, by_name(topo, p))

    starts = _local_starts(topo, cur_idx, config, reload_cost, score, churn)
    first_valid = clock() - t0 if any(not validate_placement(topo, p) for p in starts) else None
    try:
        fresh = plan_for_topology(topo, replace(config, time_limit_s=churn.fresh_share * time_limit_s), clock=clock)
        starts.append(relabel_for_fewest_moves(topo, fresh.assignments, current))
    except PlanningError:
        pass  # too little memory for a fresh cover; the repaired starts remain
    starts = [relabel_for_fewest_moves(topo, p, current) for p in starts]
    if first_valid is None and any(not validate_placement(topo, p) for p in starts):
        first_valid = clock() - t0
    if churn.cover_share > 0:
        cover = _cover(topo, current, starts, score, config, churn.cover_share * time_limit_s,
                       lambda: time_limit_s - (clock() - t0))
        if cover is not None:
            starts.append(cover)
    reserve = churn.tolerance_share * time_limit_s if tolerance > 0 else 0.0
    best = _anneal(topo, starts, score, lambda: time_limit_s - reserve - (clock() - t0), focus, config.seed,
                   churn, clock)
    if tolerance > 0:
        best = _within_tolerance(topo, current, base, best, starts, tolerance, time_limit_s - (clock() - t0),
                                 config, churn, clock)
    sol = make_solution(topo, best, config, clock() - t0, "incremental")
    return ChurnResult(sol, layers_to_load(current, by_name(topo, best)), True, clock() - t0, first_valid)


def _local_starts(topo: Topology, cur_idx: Placement, config: PlannerConfig, reload_cost: float,
                  score: Callable[[Placement], float], churn: ChurnConfig) -> list[Placement]:
    """The current placement, its repair when layers are uncovered, and an order-keeping re-cut
    (cheap, near-optimal for chain-like plans) with each newcomer inserted where it scores best."""
    starts = [cur_idx]
    if validate_placement(topo, cur_idx):
        # Uncovered layers: repair greedily first so the search starts from something valid.
        starts.append(repair(topo, cur_idx))
    order = chain_order(cur_idx)
    f0 = flow_value(topo, balanced_chain(topo), config.partial)
    floor = churn.recut_floor * f0 if f0 > 0 else None
    for i in (i for i in range(topo.num_nodes) if i not in cur_idx):
        best_pos = None
        for pos in range(len(order) + 1):
            cut = chain_rebalance(topo, order[:pos] + [i] + order[pos:], cur_idx, reload_cost, floor)
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
    return starts


def _cover(topo: Topology, current: Mapping[str, tuple[int, int]], starts: list[Placement],
           score: Callable[[Placement], float], config: PlannerConfig, budget_s: float,
           left: Callable[[], float]) -> Placement | None:
    """The cover start for the best valid start's flow, within ``budget_s`` and the time left.

    It comes before the local search: a start that single moves rarely reach (a stage jumping
    into the hole while faster nodes re-cut to fill its place). It asks for the reference's
    whole flow even under a tolerance: HiGHS settles that question in about half the time of a
    lower target (cluster24, remove 1: 1.6-2.0 s against 2.1-5.8 s), and the tolerance phase
    may cut further from its answer.
    """
    ref = max((p for p in starts if not validate_placement(topo, p)), key=score, default=None)
    if ref is None:
        return None
    return cover_start(topo, current, ref, flow_value(topo, ref, config.partial), min(budget_s, left()))


def _anneal(topo: Topology, starts: list[Placement], score: Callable[[Placement], float],
            left: Callable[[], float], focus: list[int] | None, seed: int, churn: ChurnConfig,
            clock: Callable[[], float]) -> Placement:
    """Annealing from the starts: ``focus_share`` of the time left moving only ``focus``, the
    rest (re-measured) moving everyone."""
    best, _ = improve(topo, starts, score, left() * churn.focus_share, seed=seed, movable=focus or None,
                      clock=clock)
    rest = left()
    if rest > 0:
        best, _ = improve(topo, [best], score, rest, seed=seed + churn.global_seed_offset, clock=clock)
    return best


def _within_tolerance(topo: Topology, current: Mapping[str, tuple[int, int]], base: Callable[[Placement], float],
                      best: Placement, starts: list[Placement], tolerance: float, time_limit_s: float,
                      config: PlannerConfig, churn: ChurnConfig, clock: Callable[[], float]) -> Placement:
    """The fewest-moves placement within ``tolerance`` of ``best``'s objective, from ``best``,
    the starts, and order-keeping re-cuts at flows near the target (for chain-like plans often
    the answer outright)."""
    target = (1.0 - tolerance) * base(best)
    cuts = []
    if target > 0:
        cur_idx = by_index(topo, current)
        best_flow = flow_value(topo, best, config.partial)
        flow_target = (1.0 - tolerance) * best_flow
        for step in churn.tolerance_recut_steps:
            floor = (1.0 - step) * flow_target + step * best_flow
            cut = chain_rebalance(topo, chain_order(cur_idx), cur_idx, churn.recut_price, floor)
            if cut:
                cuts.append(cut)
    return fewest_moves_within(topo, current, base, target, [best, *starts, *cuts], time_limit_s,
                               seed=config.seed + churn.tolerance_seed_offset, clock=clock)


def on_leave(
    topo: Topology,
    current: Mapping[str, tuple[int, int]],
    config: PlannerConfig,
    reload_cost: float,
    time_limit_s: float = 10.0,
    clock: Callable[[], float] = time.monotonic,
    tolerance: float = 0.0,
    churn: ChurnConfig = ChurnConfig(),
) -> ChurnResult:
    """Nodes left (``topo`` no longer has them). Recompute flows only, if coverage holds."""
    t0 = clock()
    cur_idx = by_index(topo, current)
    if not validate_placement(topo, cur_idx) and flow_value(topo, cur_idx, config.partial) > 0:
        plan = make_solution(topo, cur_idx, config, clock() - t0, "flows-only")
        return ChurnResult(plan, 0, False, clock() - t0, clock() - t0)
    return resolve(topo, current, config, reload_cost, time_limit_s, clock=clock, tolerance=tolerance, churn=churn)


def on_join(
    topo: Topology,
    current: Mapping[str, tuple[int, int]],
    config: PlannerConfig,
    reload_cost: float,
    time_limit_s: float = 10.0,
    clock: Callable[[], float] = time.monotonic,
    tolerance: float = 0.0,
    churn: ChurnConfig = ChurnConfig(),
) -> ChurnResult:
    """New nodes joined: re-solve with the newcomers (and, later, everyone) movable."""
    new = [i for i, n in enumerate(topo.nodes) if n.name not in current]
    return resolve(topo, current, config, reload_cost, time_limit_s, focus=new or None, clock=clock,
                   tolerance=tolerance, churn=churn)


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
        return ChurnResult(make_solution(topo, relabelled, config, clock() - t0, "periodic:adopted"), moved, True,
                           clock() - t0)
    plan = make_solution(topo, cur_idx, config, clock() - t0, "periodic:kept")
    return ChurnResult(plan, 0, False, clock() - t0)
