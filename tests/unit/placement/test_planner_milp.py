"""The MILP (and the search) on 3-6 node clusters against brute-force enumeration."""

from __future__ import annotations

import itertools
import random

import pytest

from p2pserve.placement.maxflow import max_flow
from p2pserve.placement.milp import MilpOptions, build_model, identical_groups, solve_milp
from p2pserve.placement.planner import PlannerConfig, plan_for_topology
from p2pserve.placement.solution import validate_placement
from p2pserve.placement.topology import LinkSpec, NodeSpec, Topology
from p2pserve.types import SINK_INDEX as SINK, SOURCE_INDEX as SOURCE
from tests.support.planner import make_topology, random_topology




_BRUTE: dict = {}


def brute_force(topo: Topology, partial: bool = True) -> float:
    """Best max-flow over every placement in which each node holds >= 1 layer (memoised)."""
    key = (id(topo), partial)
    if key not in _BRUTE:
        _BRUTE[key] = _brute_force(topo, partial)
    return _BRUTE[key]


def _brute_force(topo: Topology, partial: bool) -> float:
    L = topo.num_layers
    options = []
    for node in topo.nodes:
        opts = [(s, s + k) for k in range(1, min(node.max_layers, L) + 1) for s in range(0, L - k + 1)]
        options.append(opts)
    best = 0.0
    for combo in itertools.product(*options):
        p = dict(enumerate(combo))
        best = max(best, max_flow(topo, p, partial).value)
    return best


CASES = [(3, 5, 3, 1), (3, 6, 3, 2), (4, 4, 2, 3), (5, 3, 2, 4), (6, 3, 1, 5)]


@pytest.mark.parametrize(
    "n,L,kmax,seed,partial", [c + (True,) for c in CASES] + [CASES[0] + (False,), CASES[2] + (False,)]
)
def test_milp_matches_brute_force(n, L, kmax, seed, partial):
    topo = random_topology(n, L, kmax, seed)
    expected = brute_force(topo, partial)
    res = solve_milp(topo, 30.0, MilpOptions(partial=partial), backend="highs")
    assert res.placement is not None
    assert res.objective == pytest.approx(expected, rel=1e-6, abs=1e-6)
    # the dual bound must not cut off the optimum
    assert res.bound >= expected - 1e-4 * max(1.0, expected)


@pytest.mark.parametrize("n,L,kmax,seed", CASES[:2])
def test_paper_formulation_matches_too(n, L, kmax, seed):
    topo = random_topology(n, L, kmax, seed)
    paper = MilpOptions(tight_big_m=False, tight_validity=False, node_cap_flow=False,
                        symmetry=False, layer_pass_cut=False)
    res = solve_milp(topo, 30.0, paper, backend="highs")
    assert res.objective == pytest.approx(brute_force(topo), rel=1e-6, abs=1e-6)


def test_symmetry_breaking_keeps_optimum():
    topo = random_topology(4, 3, 2, 9, identical=True)
    assert identical_groups(topo) == [[0, 1, 2, 3]]
    with_sym = solve_milp(topo, 30.0, MilpOptions(symmetry=True), backend="highs")
    without = solve_milp(topo, 30.0, MilpOptions(symmetry=False), backend="highs")
    assert with_sym.objective == pytest.approx(without.objective, rel=1e-6)
    assert with_sym.objective == pytest.approx(brute_force(topo), rel=1e-6)


def test_warm_start_is_accepted():
    topo = random_topology(4, 4, 2, 3)
    start = {i: (min(i, 3), min(i, 3) + 1) for i in range(4)}  # one layer each: a valid chain
    res = solve_milp(topo, 30.0, MilpOptions(), warm_starts=[start], backend="highs")
    assert res.objective >= max_flow(topo, start).value - 1e-6


def test_gurobi_request_falls_back_cleanly():
    topo = random_topology(3, 4, 2, 1)
    res = solve_milp(topo, 10.0, MilpOptions(), backend="gurobi")
    assert res.backend in ("gurobi", "highs")
    assert res.objective == pytest.approx(brute_force(topo), rel=1e-6)


@pytest.mark.parametrize("n,L,kmax,seed", CASES[::2])
def test_planner_max_flow_objective_finds_optimum(n, L, kmax, seed):
    topo = random_topology(n, L, kmax, seed)
    plan = plan_for_topology(topo, PlannerConfig(objective="max-flow", time_limit_s=10.0))
    assert not validate_placement(topo, plan.assignments)
    assert plan.max_flow == pytest.approx(brute_force(topo), rel=1e-6)


def test_model_size_matches_tables_5_6():
    topo = random_topology(4, 4, 2, 3)
    pm = build_model(topo)
    # O(|C|) node variables and O(|E|) edge variables
    assert len(pm.s) == 4 and len(pm.f) == len(pm.edges) == len(pm.d)


@pytest.mark.parametrize("n,L,kmax,seed", CASES[:3])
def test_cpsat_matches_brute_force(n, L, kmax, seed):
    """Where the ``ortools`` extra is installed (``backend="auto"`` then prefers it to HiGHS):
    CP-SAT proves the brute-force optimum, up to its 0.01 tokens/s rounding of capacities."""
    from p2pserve.placement.milp.backends import cpsat_available

    if not cpsat_available():
        pytest.skip("ortools is not installed (the optional 'ortools' extra)")
    topo = random_topology(n, L, kmax, seed)
    expected = brute_force(topo)
    res = solve_milp(topo, 30.0, MilpOptions(), backend="auto")
    assert res.backend == "cpsat"
    assert res.objective == pytest.approx(expected, rel=1e-6, abs=1e-6)  # the true max-flow of its placement
    assert res.bound == pytest.approx(expected, abs=0.05 * L * n)
