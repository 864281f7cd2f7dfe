"""The coordinator's choice of each machine's TP grouping (coordinator/groupings.py): pure logic
over MachineInfo records and the planner, no processes."""

from __future__ import annotations

import pytest

from p2pserve.coordinator.groupings import (
    GroupingPolicy,
    candidate_groupings,
    choose_groupings,
    current_grouping,
    fixed_grouping,
    group_table,
    score,
)
from p2pserve.dht.machine_info import GpuLink, GpuOffer, MachineGroup, MachineInfo
from p2pserve.errors import ConfigError

ACT = 4096 * 2  # LLaMA-70B-like hidden state in fp16


def machine(n=4, bandwidth=100e9, latency=10e-6, profile=(100.0, 95.0, 90.0, 85.0), groups=(), degrees=(1, 2, 4)):
    gpus = [GpuOffer(device="gpu", memory_bytes=1 << 34, throughput_decode=list(profile)) for _ in range(n)]
    links = [GpuLink(a=a, b=b, bandwidth=bandwidth, latency_s=latency, kind="nvlink")
             for a in range(n) for b in range(a + 1, n)]
    info = MachineInfo(model="m", machine_id="M", gpus=gpus, links=links, groups=list(groups),
                       tp_degrees=[d for d in degrees if d <= n])
    info.validate()
    return info


def test_candidates_and_fixed_degrees():
    info = machine()
    assert candidate_groupings(info) == [(4,), (2, 2), (2, 1, 1), (1, 1, 1, 1)]
    assert fixed_grouping(info, 2) == (2, 2) and fixed_grouping(info, 8) == (4,)
    assert fixed_grouping(machine(n=3, degrees=(1, 2)), 4) == (2, 1)
    assert current_grouping(info) is None
    grouped = machine(groups=[MachineGroup(slots=[2, 3], peer_id="b"), MachineGroup(slots=[0, 1], peer_id="a")])
    assert current_grouping(grouped) == (2, 2)


def test_group_table_follows_the_cost_model():
    fast, slow = machine(), machine(bandwidth=1e8, latency=5e-2)
    one = group_table(fast, [0], ACT, 8)
    assert one[1:] == pytest.approx((100.0, 95.0, 90.0, 85.0))
    two = group_table(fast, [0, 1], ACT, 8)
    assert len(two) == 9 and two[1] > 1.9 * one[1]  # a fast link: nearly twice the slot
    assert group_table(slow, [0, 1], ACT, 8)[2] < one[2]  # a slow link: the all-reduces dominate


def test_auto_scores_every_grouping_and_keeps_slots_apart_over_a_slow_link():
    fast, slow = machine(), machine(bandwidth=1e8, latency=5e-2)
    values = {c: score({"M": fast}, {"M": c}, {}, 8, ACT, GroupingPolicy()) for c in candidate_groupings(fast)}
    assert all(v > 0 for v in values.values())  # every grouping holds the model
    # max-flow: a group does its slots' work plus all-reduces, so TP-1 pipelines are never worse
    assert values[(1, 1, 1, 1)] >= max(values.values()) * 0.999
    assert choose_groupings({"M": slow}, {}, num_layers=8, act_bytes=ACT) == {"M": [1, 1, 1, 1]}


def test_fixed_policy_and_hysteresis_keep_what_runs():
    info = machine(groups=[MachineGroup(slots=[i], peer_id=f"p{i}") for i in range(4)])
    assert choose_groupings({"M": info}, {}, 8, ACT, GroupingPolicy(degree=2)) == {"M": [2, 2]}
    # a gain below the hysteresis keeps the running grouping
    assert choose_groupings({"M": info}, {}, 8, ACT, GroupingPolicy(hysteresis=1e9)) == {"M": [1, 1, 1, 1]}
    with pytest.raises(ConfigError):
        GroupingPolicy.parse("3")
    assert GroupingPolicy.parse("auto").degree == 0 and GroupingPolicy.parse("4").degree == 4
