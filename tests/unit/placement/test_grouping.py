"""Choosing machines' GPU groupings (placement/grouping.py, machines.py), the HexGen §3.1
case study in the simulator (sim/tp_groups.py), and the regroup transition (placement/regroup.py)."""

from __future__ import annotations

import pytest

from p2pserve.errors import ConfigError, PlanningError
from p2pserve.helix.hexgen_clusters import case_study, case_study_layouts, full_price
from p2pserve.placement.grouping import (
    GroupingConfig,
    estimate_score,
    fixed_grouping,
    groups_of,
    machine_groupings,
    plan_choice,
    plan_grouping,
    uniform_choices,
)
from p2pserve.placement.machines import group_topology
from p2pserve.placement.regroup import Node, regroup_plan, uncovered
from p2pserve.placement.tp_cost import LLAMA2_70B, ModelShape
from p2pserve.sim.run import SimConfig, simulate
from p2pserve.sim.tp_groups import fixed_lengths_file, group_scenario
from p2pserve.sim.workload import OfflineFeeding


def test_groupings_of_a_machine():
    assert machine_groupings(4, LLAMA2_70B) == [(4,), (2, 2), (2, 1, 1), (1, 1, 1, 1)]
    assert machine_groupings(3, LLAMA2_70B) == [(2, 1), (1, 1, 1)]
    assert machine_groupings(1, LLAMA2_70B) == [(1,)]
    assert len(machine_groupings(8, LLAMA2_70B)) == 10
    # heads must split evenly: 6 KV heads forbid TP-4
    odd = ModelShape("odd", 32, 4096, 12, 6, 2, 1e8, 1024)
    assert machine_groupings(4, odd) == [(2, 2), (2, 1, 1), (1, 1, 1, 1)]
    assert fixed_grouping(3, 2, LLAMA2_70B) == (2, 1)
    assert fixed_grouping(8, 4, LLAMA2_70B) == (4, 4)
    assert fixed_grouping(4, 8, LLAMA2_70B) == (4,)


def test_groups_and_topology_of_a_choice():
    c = case_study()
    groups = groups_of(c, ((2, 2), (1, 1), (2,)))
    assert [g.d for g in groups] == [2, 2, 1, 1, 2]
    assert groups[1].gpus == ((0, 2), (0, 3))
    topo = group_topology(c, groups)
    assert topo.num_nodes == 5 and topo.nodes[0].gpu_type == "A6000x2"
    # two groups of one box talk over PCIe, boxes over the network
    assert topo.bytes_per_s(0, 1) > topo.bytes_per_s(0, 2)
    with pytest.raises(ConfigError):
        groups_of(c, ((4,), (2,)))
    with pytest.raises(ConfigError):
        groups_of(c, ((2,), (2,), (2,)))


def test_a_measured_group_replaces_the_estimate():
    c = case_study()
    groups = groups_of(c, ((4,), (2,), (2,)))
    est = group_topology(c, groups).nodes[0].profile
    slow = type(est)(est.prompt_tokens, tuple(2 * y for y in est.prompt_ms_values),
                     est.decode_tokens, tuple(2 * y for y in est.decode_ms_values))
    measured = type(c)(c.name, c.machines, c.lan, c.wan, c.client, memory=c.memory, measured={groups[0].gpus: slow})
    topo = group_topology(measured, groups)
    assert topo.nodes[0].profile is slow and topo.nodes[1].profile == group_topology(c, groups).nodes[1].profile
    assert topo.nodes[0].throughput[10] < group_topology(c, groups).nodes[0].throughput[10]


def test_search_is_deterministic_and_never_worse_than_uniform():
    cfg = GroupingConfig(eval_work=40, max_candidates=12)
    a = plan_grouping(case_study(), cfg)
    b = plan_grouping(case_study(), cfg)
    assert a.choice == b.choice and a.solution.assignments == b.solution.assignments
    key = lambda choice: "|".join(map(str, choice))  # noqa: E731  (GroupingResult.tried's keys)
    best_uniform = max(a.tried[key(c)] for c in uniform_choices(case_study(), cfg).values())
    assert a.tried[key(a.choice)] >= best_uniform
    assert not uncovered(a.solution.assignments, 80)


def test_estimate_score_is_capped_at_the_max_flow_decode_share():
    """Uniform TP-8 on the full-price cluster: the Little's-law estimate leaves the groups'
    prompt all-reduces out and ranks it above TP-4; its max-flow (T tables with prompts) does
    not, and neither does the steady-state simulation (docs/hexgen.md)."""
    c = full_price()
    cfg = GroupingConfig(eval_work=20)
    scored = {}
    for d in (4, 8):
        _, topo, sol = plan_choice(c, uniform_choices(c, cfg)[d], cfg, cfg.eval_work)
        e = sol.estimate
        assert estimate_score(topo, sol) == min(e.decode_tokens_per_s, e.compute_bound_decode_tokens_per_s)
        scored[d] = (e.decode_tokens_per_s, estimate_score(topo, sol))
    assert scored[8][0] > scored[4][0] and scored[8][1] < scored[4][1]


def test_search_reports_a_cluster_that_cannot_hold_the_model():
    small = case_study()
    small = type(small)(small.name, small.machines[2:], small.lan, small.wan, small.client, memory=small.memory)
    with pytest.raises(PlanningError):
        plan_grouping(small, GroupingConfig(eval_work=10, max_candidates=4))


def test_full_price_cluster_shape():
    c = full_price()
    assert c.num_gpus == 58 and len(c.machines) == 9
    assert c.net(0, 1).latency_s < c.net(0, 4).latency_s  # same region vs across the Atlantic


def test_case_study_ordering_in_the_simulator(tmp_path):
    """HexGen §3.1: one stage per machine (48/20/12 layers at TP 4/2/2) beats PP-8 about 2x and
    the cross-machine TP-4 layout by far more, one 128/64 request at a time."""
    lengths = fixed_lengths_file(128, 64, str(tmp_path))
    cfg = SimConfig(mode="offline", duration=120.0, warmup=10.0, lengths=lengths,
                    feeding=OfflineFeeding(initial=1, max_usage=0.0))
    c = case_study()
    tps = {name: simulate(group_scenario(group_topology(c, groups), placement), cfg).decode_throughput_tokens_per_s
           for name, (groups, placement) in case_study_layouts().items()}
    assert tps["hexgen"] > tps["pp8"] > tps["pp2_tp4"]
    assert 1.6 < tps["hexgen"] / tps["pp8"] < 2.6
    assert tps["hexgen"] / tps["pp2_tp4"] > 4


def _node(gpus, span, max_layers=40):
    return Node(frozenset(gpus), span, max_layers)


def _check(steps, num_layers):
    for st in steps:
        assert not uncovered(st.serving, num_layers), f"{st.action} {st.node} uncovers layers"


def test_regroup_with_a_replica_drops_then_loads():
    """TP-4 -> 2 x TP-2 on box A while box B's replica covers every layer: drop, then load."""
    old = {"A/tp4": _node({"a0", "a1", "a2", "a3"}, (0, 40)), "B/tp4": _node({"b0", "b1", "b2", "b3"}, (0, 40))}
    new = {"A/tp2:0": _node({"a0", "a1"}, (0, 20), 20), "A/tp2:1": _node({"a2", "a3"}, (20, 40), 20),
           "B/tp4": old["B/tp4"]}
    steps = regroup_plan(old, new, 40)
    _check(steps, 40)
    assert [s.action for s in steps] == ["drop", "load", "load"]
    assert steps[-1].serving == {n: x.span for n, x in new.items()}


def test_regroup_without_a_replica_bridges_first():
    """The only copy of layers 20..29 sits on the group being split: another node widens its
    range over them before the old group drops, and narrows back once the new groups serve."""
    old = {"A/tp4": _node({"a0", "a1", "a2", "a3"}, (20, 30)), "B": _node({"b0"}, (0, 20), 30),
           "C": _node({"c0"}, (30, 40))}
    new = {"A/tp2:0": _node({"a0", "a1"}, (20, 25), 10), "A/tp2:1": _node({"a2", "a3"}, (25, 30), 10),
           "B": old["B"], "C": old["C"]}
    steps = regroup_plan(old, new, 40)
    _check(steps, 40)
    assert [s.action for s in steps] == ["bridge", "drop", "load", "load", "unbridge"]
    assert steps[0].node == "B" and steps[0].span == (0, 30)
    assert steps[-1].serving == {n: x.span for n, x in new.items()}


def test_regroup_refuses_to_uncover_when_no_node_can_bridge():
    old = {"A/tp4": _node({"a0", "a1", "a2", "a3"}, (20, 30)), "B": _node({"b0"}, (0, 20), 20),
           "C": _node({"c0"}, (30, 40), 10)}
    new = {"A/tp2:0": _node({"a0", "a1"}, (20, 25)), "A/tp2:1": _node({"a2", "a3"}, (25, 30)),
           "B": old["B"], "C": old["C"]}
    with pytest.raises(PlanningError):
        regroup_plan(old, new, 40)
