"""Placements that load the fewest layers while keeping an objective: the churn tolerance.

* :func:`fewest_moves_within` -- the placement loading the fewest layers whose value is at least
  a target (lexicographic: reach the target first, then move least). A price per layer cannot
  say "lose at most 3 %"; a target can, and it is what an operator means.
* :func:`cover_start` -- the placement loading the fewest layers whose layer cover reaches a flow
  (an exact MILP, :mod:`move_bound`): a start single-node moves rarely reach.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping

from p2pserve.placement.move_bound import fewest_moves_for_flow
from p2pserve.placement.moves import by_index, by_name, layers_to_load
from p2pserve.placement.search import improve
from p2pserve.placement.solution import validate_placement
from p2pserve.placement.topology import Topology

Placement = dict[int, tuple[int, int]]

#: Each priced round gets this share of the time limit, but at least ``MIN_ROUND_S`` seconds.
ROUND_SHARE = 1 / 8
MIN_ROUND_S = 0.25
#: The price per move falls by this factor when a round overshot the target (traded too much
#: value away) and rises by ``PRICE_UP`` when it found nothing cheaper worth its value.
PRICE_DOWN = 0.6
PRICE_UP = 2.0


class _MoveScore:
    """The lexicographic score of :func:`fewest_moves_within` and its helpers, values cached.

    Invalid placements score ``-4 big``; valid ones below the target ``-big`` minus their
    shortfall; those reaching it minus their moves (``big`` exceeds any reload count).
    """

    def __init__(self, topo: Topology, current: Mapping[str, tuple[int, int]],
                 value: Callable[[Placement], float], target: float) -> None:
        self.topo, self.current, self.value, self.target = topo, current, value, target
        self.big = float(topo.num_layers * max(1, topo.num_nodes) + 1)  # more than any reload
        self.cur_idx = by_index(topo, current)
        self.known: dict[tuple, float | None] = {}  # placement -> value (None: invalid); rounds revisit many

    def moves(self, p) -> int:
        """Layers ``p`` loads."""
        return layers_to_load(self.current, by_name(self.topo, p))

    def valid_value(self, p) -> float | None:
        """``value(p)``, or None when ``p`` is not a valid placement."""
        key = tuple(sorted(p.items()))
        if key not in self.known:
            self.known[key] = None if validate_placement(self.topo, p) else self.value(p)
        return self.known[key]

    def score(self, p) -> float:
        """The lexicographic score (see class docstring)."""
        v = self.valid_value(p)
        big = self.big
        if v is None:
            return -4 * big
        if v >= self.target:
            return -float(self.moves(p))
        return -big - big * (self.target - v) / max(abs(self.target), 1e-12)

    def priced(self, price: float) -> Callable[[Mapping[int, tuple[int, int]]], float]:
        """Value minus ``price`` per moved layer (invalid: ``-4 big``)."""

        def priced(p) -> float:
            v = self.valid_value(p)
            return -4 * self.big if v is None else v - price * self.moves(p)

        return priced

    def undo(self, p: Mapping[int, tuple[int, int]], in_time: Callable[[], bool]) -> Placement:
        """Give nodes back their current range, largest reload first, while the score improves."""
        p = dict(p)
        cur_idx, topo = self.cur_idx, self.topo
        improved = True
        while improved and in_time():
            improved = False
            changed = sorted((i for i in p if cur_idx.get(i) != p[i]),
                             key=lambda i: -layers_to_load(self.current, {topo.nodes[i].name: p[i]}))
            for i in changed:
                q = dict(p)
                if i in cur_idx:
                    q[i] = cur_idx[i]
                else:
                    del q[i]  # a newcomer left idle loads nothing
                if self.score(q) > self.score(p):
                    p, improved = q, True
        return p


def fewest_moves_within(
    topo: Topology,
    current: Mapping[str, tuple[int, int]],
    value: Callable[[Placement], float],
    target: float,
    starts: list[Mapping[int, tuple[int, int]]],
    time_limit_s: float,
    seed: int = 0,
    clock: Callable[[], float] = time.monotonic,
) -> Placement:
    """The placement loading the fewest layers whose ``value`` is at least ``target``.

    Lexicographic: any valid placement reaching the target beats every one that does not; among
    those, fewer moved layers win. Each start first gets a greedy undo (give nodes back their
    current range, largest reload first, while the target holds); then rounds of annealing, on
    that score and on value minus a price per move, refine the best. Falls back to the start
    with the highest value when none reaches the target.
    """
    t0 = clock()
    ms = _MoveScore(topo, current, value, target)

    def in_time() -> bool:
        return clock() - t0 < time_limit_s

    feasible = [dict(p) for p in starts if p and ms.score(p) > -ms.big]
    if not feasible:
        return max((dict(p) for p in starts if p), key=ms.score)
    best = max((ms.undo(p, in_time) for p in feasible), key=ms.score)
    # The start that moves least (typically the current placement, repaired): the priced rounds
    # climb from it too, since a fresh solve's placement, relabelled, is often out of reach of
    # single moves from the best.
    low = min((dict(p) for p in starts if p and ms.valid_value(p) is not None), key=ms.moves, default=None)
    return _priced_rounds(topo, ms, best, low, seed, time_limit_s, in_time, lambda: clock() - t0, clock)


def _priced_rounds(topo: Topology, ms: _MoveScore, best: Placement, low: Placement | None, seed: int,
                   time_limit_s: float, in_time: Callable[[], bool], elapsed: Callable[[], float],
                   clock: Callable[[], float]) -> Placement:
    """Rounds of annealing on value - price x moves, smooth where the lexicographic score is a
    cliff. Each round climbs from two sides: down from the fewest-moves placement that reaches
    the target, and up from ``low``. The price rises while the rounds find nothing cheaper,
    falls when they overshoot the target."""
    best_value = ms.valid_value(best)
    assert best_value is not None, "best is a valid placement"
    slack = max(best_value - ms.target, 0.01 * abs(ms.target), 1e-12)
    price = slack / max(1, ms.moves(best))  # dropping every move would cost exactly the slack
    rounds = 0
    while in_time() and ms.moves(best) > 0:
        slice_s = min(time_limit_s - elapsed(), max(MIN_ROUND_S, time_limit_s * ROUND_SHARE))
        priced = ms.priced(price)
        froms = [best] if low is None or ms.moves(low) >= ms.moves(best) else [best, low]
        # The lexicographic score itself, from the best so far: it keeps the target exactly.
        found = [improve(topo, [best], ms.score, slice_s / 2, seed=seed + 3 * rounds, clock=clock)[0]]
        found += [ms.undo(improve(topo, [f], priced, slice_s / 2 / len(froms), seed=seed + 3 * rounds + 1 + k,
                                  clock=clock)[0], in_time) for k, f in enumerate(froms)]
        rounds += 1
        cand = max(found, key=ms.score)
        if ms.score(cand) > ms.score(best):
            best = cand  # keep the price: there may be more at it
        elif all((ms.valid_value(c) or float("-inf")) < ms.target for c in found[1:]):
            price *= PRICE_DOWN
        else:
            price *= PRICE_UP
    return best


def cover_start(
    topo: Topology,
    current: Mapping[str, tuple[int, int]],
    best: Mapping[int, tuple[int, int]],
    flow_target: float,
    time_limit_s: float,
) -> Placement | None:
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
