"""The planner at scale: regions from links, cells, stitched plans and re-plans after leaves."""

from __future__ import annotations

import random

import pytest
from dataclasses import replace

from p2pserve.helix.scale import five_regions, scale_cluster
from p2pserve.helix.topology import topology_from_helix
from p2pserve.placement.cells import cell_key, cell_topologies, split_region
from p2pserve.placement.maxflow import max_flow
from p2pserve.placement.moves import by_name
from p2pserve.placement.planner import PlannerConfig, plan_for_topology
from p2pserve.placement.regions import find_regions
from p2pserve.placement.scale import (
    ScaleConfig, cell_share, cells_by_name, plan_at_scale, region_of_name, search_limit,
)
from p2pserve.placement.scale_churn import replan_after_leave
from p2pserve.placement.solution import validate_placement
from p2pserve.placement.stitch import balance, cell_flows, twin_share
from p2pserve.types import SINK_INDEX, SOURCE_INDEX

MODEL = "llama2_70b"
SMALL = ScaleConfig(direct_nodes=8, first_work=20, cell_work=40)


def generated(n: int, sample: int | None = 4):
    return topology_from_helix(scale_cluster(five_regions(n), f"g{n}", inter_sample=sample), MODEL)


def test_generated_cluster_keeps_region_links_and_a_bounded_sample():
    topo = generated(100, sample=4)
    lan = [l for l in topo.links if l.src >= 0 and l.dst >= 0 and l.latency_s < 0.01]
    wan = [l for l in topo.links if l.src >= 0 and l.dst >= 0 and l.latency_s >= 0.01]
    assert len(lan) == 5 * 20 * 19  # every directed pair inside each region
    assert len(wan) <= 2 * 4 * 100  # each node drew at most 4 links out of its region


def test_regions_are_found_from_link_latency_alone():
    topo = generated(100)
    regions = find_regions(topo)
    assert [len(r) for r in regions] == [20] * 5
    assert regions[0] == list(range(20))


def test_a_region_that_cannot_hold_the_model_joins_its_best_connected_neighbour():
    # region 1 holds two T4s (8 layers of 80): it cannot serve alone
    topo = topology_from_helix(scale_cluster([[("A100", 8)], [("T4", 2)], [("A100", 8)]], "tiny", inter_sample=None),
                               MODEL)
    regions = find_regions(topo)
    assert len(regions) == 2
    assert sorted(len(r) for r in regions) == [8, 10]


def test_cells_of_a_region_get_the_same_mix_and_the_same_key():
    topo = generated(160)  # 32 per region: 8 of each type
    region = find_regions(topo)[1]
    cells = split_region(topo, region, cell_nodes=16)
    assert len(cells) == 2 and sorted(sum(cells, [])) == sorted(region)
    mix = [sorted(topo.nodes[i].gpu_type for i in c) for c in cells]
    assert mix[0] == mix[1]
    subs = cell_topologies(topo, cells)
    assert cell_key(subs[0]) == cell_key(subs[1])
    # the home region's cells see the coordinator over the LAN: a different problem
    home = cell_topologies(topo, split_region(topo, find_regions(topo)[0], cell_nodes=16))
    assert cell_key(home[0]) != cell_key(subs[0])


def test_a_cell_topology_keeps_only_its_own_links():
    topo = generated(160)
    cells = split_region(topo, find_regions(topo)[2], cell_nodes=16)
    sub = cell_topologies(topo, cells)[0]
    n = sub.num_nodes
    assert all(l.src in (SOURCE_INDEX,) or 0 <= l.src < n for l in sub.links)
    assert all(l.dst in (SINK_INDEX,) or 0 <= l.dst < n for l in sub.links)
    assert len([l for l in sub.links if l.src >= 0 and l.dst >= 0]) == n * (n - 1)


def test_balance_scales_flows_down_to_shares_of_concurrency():
    a = {(SOURCE_INDEX, 0): 10.0, (0, SINK_INDEX): 10.0}
    b = {(SOURCE_INDEX, 1): 30.0, (1, SINK_INDEX): 30.0}
    out = balance([a, b], [1.0, 1.0])
    assert out[0] == a  # never scaled up
    assert out[1][(SOURCE_INDEX, 1)] == 10.0 and out[1][(1, SINK_INDEX)] == 10.0


def test_twins_are_counted_inside_cells_only():
    placement = {0: (0, 40), 1: (40, 80), 2: (0, 40), 3: (40, 80)}
    assert twin_share(placement, [[0, 1], [2, 3]]) == 0.0
    assert twin_share(placement, [[0, 1, 2, 3]]) == 1.0


def test_plan_at_scale_is_valid_its_flows_feasible_and_deterministic():
    topo = generated(100)
    sol = plan_at_scale(topo, PlannerConfig(), SMALL)
    assert validate_placement(topo, sol.assignments) == []
    st = sol.stats["scale"]
    assert st["regions"] == 5 and st["distinct_cells"] < st["cells"]
    # the stitched flow respects every node's throughput and every link's capacity
    into: dict[int, float] = {}
    for (u, v), f in sol.flows.items():
        assert f <= topo.capacity(u, v) + 1e-6
        if v != SINK_INDEX:
            into[v] = into.get(v, 0.0) + f
    for i, f in into.items():
        s, e = sol.assignments[i]
        assert f <= topo.nodes[i].throughput[e - s] + 1e-6
    # stitched flows are a feasible flow, so never above the whole graph's max-flow
    assert sol.max_flow <= max_flow(topo, sol.assignments).value + 1e-6
    again = plan_at_scale(topo, PlannerConfig(), SMALL)
    assert again.assignments == sol.assignments
    assert set(region_of_name(sol).values()) == {f"r{x}" for x in range(5)}


def test_cell_flows_are_the_plans_stitched_flows_and_pool_broken_cells():
    topo = generated(100)
    sol = plan_at_scale(topo, PlannerConfig(), SMALL)
    index = {n.name: i for i, n in enumerate(topo.nodes)}
    cells = [[index[x] for x in c] for c in cells_by_name(sol)]
    fr = cell_flows(topo, sol.assignments, cells)
    assert fr.value == pytest.approx(sol.max_flow)
    assert all(fr.edge_flows.get(e, 0.0) == pytest.approx(f) for e, f in sol.flows.items())
    # a cell that lost a layer's only holder is pooled with the nodes in no cell: no route crosses
    # into a covering cell, and the covering cells still carry their flow
    gone = next(i for i in cells[0] if sum(1 for j in cells[0] if sol.assignments.get(j) == sol.assignments.get(i)) == 1)
    broken = {i: r for i, r in sol.assignments.items() if i != gone}
    cell_of = {i: c for c, members in enumerate(cells) for i in members}
    fb = cell_flows(topo, broken, cells)
    assert 0 < fb.value < fr.value
    for (u, v), f in fb.edge_flows.items():
        if f > 0 and u >= 0 and v >= 0:
            assert cell_of[u] == cell_of[v]


def test_a_cells_share_of_the_deadline_and_the_limit_that_gives_its_search_that_share():
    assert cell_share(6.0, 3) == 2.0 and cell_share(-1.0, 2) == 0.0 and cell_share(1.0, 0) == 1.0
    for share, nodes in ((2.0, 30), (0.1, 24)):
        limit = search_limit(share, nodes)
        # what the throughput objective leaves its search of a limit (planner._solve_throughput)
        assert abs(limit * 0.95 - 0.05 * nodes - share) < 1e-9


def test_a_slow_machine_gets_a_valid_plan_by_the_deadline():
    """A clock that runs fast (each reading a tenth of a second later: a machine ten times slower
    than the work needs) cuts the improving searches; the best plan so far is still valid."""
    topo = generated(100)
    ticks = iter(range(10**9))
    sol = plan_at_scale(topo, PlannerConfig(time_limit_s=5.0), ScaleConfig(direct_nodes=8, first_work=20, cell_work=200),
                        clock=lambda: 0.1 * next(ticks))
    st = sol.stats["scale"]
    assert validate_placement(topo, sol.assignments) == []
    assert st["stopped_by"] == "time"
    quiet = plan_at_scale(topo, PlannerConfig(time_limit_s=5.0), replace(SMALL, time_limit_s=1e6),
                          clock=lambda: 0.0)
    assert quiet.stats["scale"]["stopped_by"] == "work"
    assert quiet.stats["scale"]["improved_cells"] == quiet.stats["scale"]["distinct_cells"]


def test_small_swarms_get_todays_planner_unchanged(cluster10):
    cfg = PlannerConfig(work=200)
    assert plan_at_scale(cluster10, cfg).assignments == plan_for_topology(cluster10, cfg).assignments


def test_replan_after_leaves_moves_only_damaged_cells():
    topo = generated(100)
    sol = plan_at_scale(topo, PlannerConfig(), SMALL)
    cells = cells_by_name(sol)
    gone_names = {topo.nodes[i].name for i in random.Random(1).sample(range(100), 5)}
    after, _ = topo.without([i for i, n in enumerate(topo.nodes) if n.name in gone_names])
    current = by_name(topo, sol.assignments)
    r = replan_after_leave(after, current, cells, PlannerConfig(), work=30)
    assert validate_placement(after, r.plan.assignments) == []
    new = by_name(after, r.plan.assignments)
    damaged = {c for c, names in enumerate(cells) if gone_names & set(names)}
    for c, names in enumerate(cells):
        if c not in damaged:
            assert all(new.get(x) == current.get(x) for x in names)  # untouched cells keep every range
    assert {rep.cell for rep in r.repairs} <= damaged
    assert r.layers_moved == sum(rep.layers_moved for rep in r.repairs)
    again = replan_after_leave(after, current, cells, PlannerConfig(), work=30)
    assert again.plan.assignments == r.plan.assignments


def test_no_leave_means_no_move():
    topo = generated(100)
    sol = plan_at_scale(topo, PlannerConfig(), SMALL)
    r = replan_after_leave(topo, by_name(topo, sol.assignments), cells_by_name(sol), PlannerConfig(), work=30)
    assert r.layers_moved == 0 and r.repairs == ()
