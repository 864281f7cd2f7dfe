"""HexGen's symmetric baseline (placement/symmetric.py): equal stages, one degree, one region."""

from __future__ import annotations

from collections import Counter

from p2pserve.helix.hexgen_clusters import case_study, full_price
from p2pserve.placement.grouping import GroupingConfig, groups_of, plan_grouping, uniform_choices
from p2pserve.placement.machines import group_topology
from p2pserve.placement.symmetric import challenge_with_symmetric, symmetric_layouts, symmetric_placement


def test_every_layout_is_pipelines_of_equal_stages_of_one_degree_inside_a_region():
    c = full_price()
    layouts = symmetric_layouts(c)
    assert {lay.degree for lay in layouts} == {1, 2, 4, 8}
    for lay in layouts:
        per = 80 // lay.stages
        assert 80 % lay.stages == 0 and len(lay.placement) == lay.pipelines * lay.stages
        assert all(e - s == per for s, e in lay.placement.values())
        assert all(lay.groups[i].d == lay.degree for i in lay.placement)
        assert all(lay.topology.nodes[i].max_layers >= per for i in lay.placement)
        # each layer range is held once per pipeline: every pipeline covers the whole model
        assert set(Counter(lay.placement.values()).values()) == {lay.pipelines}
        # pipelines stay inside a region: each region holds every stage equally often
        by_region: dict[str, Counter] = {}
        for i, r in lay.placement.items():
            by_region.setdefault(c.machines[lay.groups[i].machine].region, Counter())[r] += 1
        for counts in by_region.values():
            assert len(counts) == lay.stages and len(set(counts.values())) == 1


def test_stages_that_do_not_divide_the_model_or_fit_no_group_give_nothing():
    c = case_study()
    choice = uniform_choices(c, GroupingConfig())[1]
    groups = groups_of(c, choice)
    topo = group_topology(c, groups)
    assert symmetric_placement(c, groups, topo, 1, 3) == {}  # 80 % 3 != 0
    assert symmetric_placement(c, groups, topo, 1, 1) == {}  # no single GPU holds 80 layers
    one = symmetric_placement(c, groups, topo, 1, 4)
    assert sorted(one.values()) == [(0, 20), (20, 40), (40, 60), (60, 80)]


def test_a_symmetric_layout_the_score_prefers_replaces_the_search_result():
    c, cfg = case_study(), GroupingConfig(eval_work=20, max_candidates=4)
    layouts = symmetric_layouts(c, cfg)
    two = next(lay for lay in layouts if lay.stages == 2)

    def prefers_two_stages(topo, sol):  # the search's own placements score 1
        return 2.0 if sol.method == "symmetric" and len(set(sol.assignments.values())) == 2 else 1.0

    searched = plan_grouping(c, cfg, score=prefers_two_stages)
    won = challenge_with_symmetric(c, searched, cfg, prefers_two_stages, layouts)
    assert won.solution.method == "symmetric" and won.score == 2.0
    assert won.choice == two.choice and won.solution.assignments == two.placement
    assert won.solution.max_flow > 0 and won.solve_time_s >= searched.solve_time_s
    assert set(won.tried) == set(searched.tried) | {f"symmetric tp{lay.degree} x {lay.stages}" for lay in layouts}


def test_the_search_result_stays_on_a_tie():
    c, cfg = case_study(), GroupingConfig(eval_work=20, max_candidates=4)
    searched = plan_grouping(c, cfg, score=lambda topo, sol: 1.0)
    kept = challenge_with_symmetric(c, searched, cfg, lambda topo, sol: 1.0)
    assert kept.choice == searched.choice and kept.solution is searched.solution and kept.score == 1.0
    assert len(kept.tried) > len(searched.tried)
