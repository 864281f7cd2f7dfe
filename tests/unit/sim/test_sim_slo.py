"""Latency SLOs in the simulator (HexGen's metric): deadlines, attainment, peak rate within SLO."""

from __future__ import annotations

import pytest

from p2pserve.errors import ConfigError
from p2pserve.helix.format import load_profile
from p2pserve.helix.hexgen_clusters import case_study, case_study_layouts
from p2pserve.placement.grouping import GroupingConfig, plan_grouping
from p2pserve.placement.machines import group_topology
from p2pserve.placement.profile import LatencyProfile
from p2pserve.sim.metrics import Distribution, SimResult
from p2pserve.sim.slo import SloSearch, SloSpec, attainment, peak_rate, probe
from p2pserve.sim.tp_groups import group_scenario, slo_score

FLAT = LatencyProfile((1.0, 1000.0), (2.0, 2.0), (1.0, 100.0), (1.0, 1.0))  # 2 ms prefill, 1 ms decode


def _result(completions, arrived) -> SimResult:
    nan = Distribution.of([])
    return SimResult(0.0, nan, nan, 1.0, 0, 0, 0, 0.0, 0.0, 0, 0.0,
                     extra={"arrivals_in_window": arrived}, completions=completions)


def test_deadline_is_scale_times_whole_model_reference_latency():
    spec = SloSpec(FLAT, layers=10, scale=3.0)
    # 10 layers x (2 ms prefill + 4 decode steps x 1 ms) = 60 ms, x3
    assert spec.deadline(100, 5) == pytest.approx(0.18)
    with pytest.raises(ConfigError):
        SloSpec(FLAT, layers=10, goal=0.0)


def test_attainment_counts_unfinished_arrivals_as_missed():
    spec = SloSpec(FLAT, layers=10, scale=1.0)  # deadline(100, 5) = 60 ms
    res = _result([(100, 5, 0.05), (100, 5, 0.07)], arrived=4)
    assert attainment(res, spec) == 0.25
    assert attainment(_result([], arrived=0), spec) == 1.0
    offline = _result([], arrived=0)
    offline.extra.pop("arrivals_in_window")
    with pytest.raises(ConfigError):
        attainment(offline, spec)


def test_peak_rate_of_the_case_study_layouts_keeps_the_papers_order():
    """HexGen §3.1 under its own metric: the asymmetric layout sustains a higher request rate
    within the SLO than eight single-GPU stages (the real simulator, short windows)."""
    cluster = case_study()
    spec = SloSpec(load_profile("llama2-70b", "a100"), 80, scale=5.0, goal=0.9)
    search = SloSearch(low=0.02, high=4.0, steps=5, duration=60.0, warmup=10.0, drain=60.0)
    rates = {}
    for name in ("hexgen", "pp8"):
        groups, placement = case_study_layouts()[name]
        point = peak_rate(group_scenario(group_topology(cluster, groups), placement), spec, search)
        assert point.sims == 1 + search.steps
        assert point.rate_qps == 0.0 or point.attainment >= spec.goal
        rates[name] = point.rate_qps
    assert rates["hexgen"] > rates["pp8"]
    groups, placement = case_study_layouts()["hexgen"]
    scenario = group_scenario(group_topology(cluster, groups), placement)
    a, res = probe(scenario, spec, 100.0, search)  # far past the peak: most requests miss
    assert a < spec.goal and res.extra["arrivals_in_window"] > 0
    # A rate to beat that the layout cannot hold costs one simulation, not a bisection.
    lost = peak_rate(scenario, spec, search, at_least=100.0)
    assert lost.rate_qps == 0.0 and lost.sims == 1


def test_slo_scored_grouping_search_picks_hexgens_case_study_grouping():
    """Scored by the peak rate within the SLO, the grouping search chooses TP 4 / 2 / 2 on the
    §3.1 boxes (HexGen's layout); scored by offline throughput it would not."""
    spec = SloSpec(load_profile("llama2-70b", "a100"), 80, scale=5.0, goal=0.9)
    search = SloSearch(low=0.02, high=4.0, steps=4, duration=60.0, warmup=10.0, drain=60.0)
    res = plan_grouping(case_study(), GroupingConfig(eval_work=100, max_candidates=12),
                        score=slo_score(spec, search))
    assert res.choice == ((4,), (2,), (2,))
