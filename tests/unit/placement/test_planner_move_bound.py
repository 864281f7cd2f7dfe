"""The layer-cover move bound against brute-force enumeration of every placement."""

from __future__ import annotations

import itertools
import random

import pytest

from p2pserve.placement import move_bound as mb
from p2pserve.placement.maxflow import flow_value
from p2pserve.placement.moves import new_layer_count
from p2pserve.placement.solution import validate_placement
from tests.support.planner import make_topology
from tools.move_ceiling import cover_of, max_cover_within


def all_placements(topo):
    """Every placement: each node idle or on one range it can hold."""
    L = topo.num_layers
    options = []
    for node in topo.nodes:
        opts = [None] + [(s, s + k) for k in range(1, min(node.max_layers, L) + 1) for s in range(L - k + 1)]
        options.append(opts)
    for combo in itertools.product(*options):
        yield {i: r for i, r in enumerate(combo) if r is not None}


def moves(current, placement) -> int:
    return sum(new_layer_count(current.get(i), s, e) for i, (s, e) in placement.items())


_ENUM: dict = {}


def enumerated(n: int, L: int, kmax: int, seed: int):
    """(topology, [(placement, max-flow)]) for every placement, memoised across tests."""
    key = (n, L, kmax, seed)
    if key not in _ENUM:
        topo = make_topology(n, L, kmax, seed)
        _ENUM[key] = (topo, [(p, flow_value(topo, p, True)) for p in all_placements(topo)])
    return _ENUM[key]


CASES = [(3, 6, 3, 1), (3, 6, 3, 2), (4, 5, 3, 3)]


@pytest.mark.parametrize("case", CASES)
def test_cover_is_an_upper_bound_on_max_flow(case):
    topo, rows = enumerated(*case)
    for p, flow in rows:
        assert flow <= cover_of(topo, p) + 1e-6


@pytest.mark.parametrize("case", CASES)
def test_fewest_moves_never_exceeds_the_true_minimum(case):
    """The proven lower bound is at most the fewest layers any placement reaching the flow loads,
    and "none" only when brute force finds none within ``max_cost``."""
    topo, rows = enumerated(*case)
    rng = random.Random(case[-1])
    valid = [(p, f) for p, f in rows if f > 0 and not validate_placement(topo, p)]
    best = max(f for _, f in valid)
    for _ in range(4):
        current, _ = rng.choice(valid)
        for share in (0.5, 0.8, 0.95):
            target = share * best
            for max_cost in (1, 3, topo.num_layers * topo.num_nodes):
                reach = [moves(current, p) for p, f in rows if f >= target - 1e-9 and moves(current, p) <= max_cost]
                res = mb.fewest_moves_for_flow(topo, current, target, max_cost, time_limit_s=20)
                if res.lower is None:
                    assert not reach, (current, target, max_cost, min(reach))
                else:
                    assert res.lower <= min(reach, default=max_cost + 1)
                    assert res.placement is not None
                    assert cover_of(topo, res.placement) >= target - 1e-6
                    assert moves(current, res.placement) <= max_cost


@pytest.mark.parametrize("case", CASES)
def test_max_cover_within_bounds_every_placement_in_budget(case):
    topo, rows = enumerated(*case)
    rng = random.Random(7 + case[-1])
    valid = [p for p, f in rows if f > 0 and not validate_placement(topo, p)]
    for _ in range(3):
        current = rng.choice(valid)
        for budget in (0, 2, 5):
            res = max_cover_within(topo, current, budget, time_limit_s=20)
            best_in_budget = max(f for p, f in rows if moves(current, p) <= budget)
            assert res.cover_upper >= best_in_budget - 1e-6
            assert res.placement is not None and moves(current, res.placement) <= budget


def test_candidates_cost_what_a_node_must_load():
    topo = make_topology(2, 8, 4, 5)
    current = {0: (2, 5)}
    for c in mb.candidates(topo, current, 2):
        assert c.cost <= 2
        assert c.cost == new_layer_count(current.get(c.node), c.start, c.end)
        assert c.throughput == topo.nodes[c.node].throughput[c.end - c.start]
    # sub-ranges of what node 0 holds are free; a newcomer pays for every layer
    assert new_layer_count((2, 5), 3, 5) == 0
    assert new_layer_count((2, 5), 1, 6) == 2
    assert new_layer_count(None, 1, 3) == 2


def test_bound_still_solves_after_the_placement_milp_ran_in_this_process():
    """HiGHS keeps one thread scheduler per process and answers "Not Set" at once to a model
    that asks for another thread count: the bound must use the placement MILP's."""
    from p2pserve.placement.milp import MilpOptions, solve_milp

    topo = make_topology(3, 6, 3, 1)
    solve_milp(topo, time_limit_s=2.0, opts=MilpOptions())
    res = mb.fewest_moves_for_flow(topo, {}, 1.0, max_cost=topo.num_layers * topo.num_nodes)
    assert res.status == "Optimal" and res.lower is not None and res.lower >= topo.num_layers


def test_max_cover_within_says_at_once_when_the_budget_cannot_cover_every_layer():
    topo, rows = enumerated(*CASES[0])
    current = {0: (0, 2)}  # layers 2-6 held by nobody: no budget under 4 layers can serve them
    for budget in (1, 3):
        res = max_cover_within(topo, current, budget, time_limit_s=20)
        assert res.cover_upper == 0.0 and res.optimal
        assert max(f for p, f in rows if moves(current, p) <= budget) == 0.0
    assert max_cover_within(topo, current, 4, time_limit_s=20).cover_upper > 0
