"""The publish guard: never publish a placement the validated check (a short
simulation) ranks below the best heuristic baseline, even where the estimate misleads."""

from __future__ import annotations

import pytest

from p2pserve.helix import format as hf
from p2pserve.helix.root import data_root
from p2pserve.helix.topology import load_helix_topology
from p2pserve.placement.estimate import estimate
from p2pserve.placement.guard import FINAL, guard
from p2pserve.placement.heuristics import separate_pipelines, swarm_even
from p2pserve.placement.planner import PlannerConfig, plan_for_topology
from p2pserve.placement.search import balanced_chain
from p2pserve.sim.plan_check import simulation_check

GEO = "clusters/distributed/cluster24_geo.ini"


@pytest.fixture(scope="module")
def geo():
    """The geo-distributed cluster24 (3 regions, 100 Mb/s and 50 ms between them) and its check:
    a short simulation (30 s warm-up + 60 s, simulator seed 1)."""
    topo = load_helix_topology(data_root() / GEO, "llama2-70b")
    check = simulation_check(hf.load_cluster(data_root() / GEO), "llama2-70b", duration=60.0, warmup=30.0)
    return topo, check


def test_guard_overrules_a_misleading_estimate(geo):
    """The balanced chain crosses the 50 ms region boundaries on most of its 24 hops: the
    estimate ranks it above separate pipelines and Swarm, the simulator serves next to nothing."""
    topo, check = geo
    chain, baselines = balanced_chain(topo), {"separate": separate_pipelines(topo), "swarm": swarm_even(topo)}
    est = {n: estimate(topo, p).decode_tokens_per_s for n, p in {FINAL: chain, **baselines}.items()}
    assert est[FINAL] > max(est["separate"], est["swarm"])  # the estimate alone would publish the chain
    res = guard(chain, baselines, check)
    assert res.overruled and res.chosen == "separate"
    assert res.scores["separate"] > 10 * res.scores[FINAL]
    assert res.placement == separate_pipelines(topo)


def test_guard_keeps_the_final_candidate_on_ties():
    res = guard({0: (0, 1)}, {"same": {0: (0, 1)}, "other": {1: (0, 1)}}, lambda p: 1.0)
    assert res.chosen == FINAL and set(res.scores) == {FINAL, "other"}


def test_plan_with_check_never_publishes_below_a_baseline(geo):
    """Helix's max-flow objective builds a deep chain across the regions; with a check the
    planner publishes the best baseline instead, and says so."""
    topo, check = geo
    cfg = PlannerConfig(objective="max-flow", use_milp=False, work=300, time_limit_s=120)
    plain = plan_for_topology(topo, cfg)
    sol = plan_for_topology(topo, cfg, check=check)
    scores = sol.stats["guard"]["scores"]
    assert sol.stats["guard"]["chosen"] != FINAL and "+guard(" in sol.method
    assert scores[sol.stats["guard"]["chosen"]] == max(scores.values())
    assert check(sol.assignments) >= max(scores.values()) - 1e-3  # deterministic: same seed, same score
    assert check(plain.assignments) < max(scores.values())


def test_refine_climbs_on_the_check_and_is_seeded(geo):
    """A few checks of hill-climbing from Petals on the geo cluster: never worse than the start,
    within its budget, the same placement for the same seed."""
    from p2pserve.placement.heuristics import petals_greedy
    from p2pserve.placement.refine import refine

    topo, check = geo
    start = petals_greedy(topo)
    p1, st1 = refine(topo, start, check, checks=4, seed=7)
    p2, st2 = refine(topo, start, check, checks=4, seed=7)
    assert p1 == p2 and st1 == st2
    assert st1.checks <= 4 and st1.best_score >= st1.start_score
    assert check(p1) == pytest.approx(st1.best_score)


def test_plan_with_refine_only_raises_the_check(geo):
    """``refine_checks`` climbs from the guard's choice: the published placement's check is at
    least the best the guard saw, and the climb stays within its budget."""
    topo, check = geo
    cfg = PlannerConfig(objective="max-flow", use_milp=False, work=300, time_limit_s=120, refine_checks=3, challengers=1)
    sol = plan_for_topology(topo, cfg, check=check)
    assert sol.stats["refine"]["checks"] <= 3
    assert sol.stats["refine"]["best_score"] >= max(sol.stats["guard"]["scores"].values()) - 1e-3
    assert check(sol.assignments) == pytest.approx(sol.stats["refine"]["best_score"], abs=1e-3)
