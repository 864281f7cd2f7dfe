"""The prefill/decode split in the simulator (sim/disagg.py, sim/split_search.py) on the Helix
authors' high-heterogeneity cluster: KV moves once per layer, decode nodes never run a prompt."""

from __future__ import annotations

import pytest

from p2pserve.errors import ConfigError
from p2pserve.helix import format as hf
from p2pserve.helix.root import data_root
from p2pserve.helix.topology import load_helix_topology
from p2pserve.sim.disagg import KV_BYTES_PER_TOKEN_LAYER, SplitPlacement, kv_parts, simulated_split
from p2pserve.sim.request import Stage
from p2pserve.sim.split_search import full_split_fits, nodes_by_type, search_split, split_placement

MODEL = "llama2-70b"
C42 = "clusters/heterogeneity/cluster42.ini"
C24 = "clusters/single_cluster/cluster24.ini"


def test_kv_parts_move_each_layer_once_between_overlapping_stages():
    prompt = (Stage(1, 0, 50), Stage(2, 50, 80))
    decode = (Stage(7, 0, 30), Stage(8, 30, 60), Stage(9, 60, 80))
    parts = kv_parts(prompt, decode, tokens=100, kv_bytes=10)
    assert parts == [(1, 7, 30 * 1000), (1, 8, 20 * 1000), (2, 8, 10 * 1000), (2, 9, 20 * 1000)]
    assert sum(b for *_, b in parts) == 80 * 100 * 10


def test_a_node_serves_one_side_only():
    with pytest.raises(ConfigError):
        SplitPlacement({1: (0, 80)}, {1: (0, 80), 2: (0, 80)}).validate()


def test_split_on_cluster42_decodes_without_prompts_on_decode_nodes():
    root = data_root()
    topo = load_helix_topology(root / C42, MODEL)
    split = split_placement(topo, {"A100": 4, "L4x2": 3, "T4x2": 1, "L4": 1, "V100": 1})
    assert not set(split.prefill) & set(split.decode)
    res = simulated_split(hf.load_cluster(root / C42), MODEL, split, duration=60.0, warmup=30.0)
    assert res.decode_throughput_tokens_per_s > 0 and res.queries_finished_in_window > 0
    ex = res.extra
    assert ex["prefill_nodes"] == sorted(split.prefill) and ex["decode_nodes"] == sorted(split.decode)
    # every prompt token's KV crossed once per layer: bytes == tokens x layers x entry size
    assert ex["kv_transfer_gb"] * 1e9 == pytest.approx(
        ex["kv_prompt_tokens"] * 80 * KV_BYTES_PER_TOKEN_LAYER[MODEL], rel=1e-3)
    assert ex["decode_prompt_tokens_run"] == 0  # decode nodes never ran a prompt


def test_a_full_split_needs_two_copies_of_the_model():
    root = data_root()
    assert full_split_fits(load_helix_topology(root / C42, MODEL))
    assert not full_split_fits(load_helix_topology(root / C24, MODEL))  # 152 layer slots < 160


def test_split_search_climbs_by_one_node_of_one_type():
    topo = load_helix_topology(data_root() / C42, MODEL)
    value = {"A100": 10.0, "L4x2": 1.0, "T4x2": -1.0}

    def score(split: SplitPlacement) -> float:  # a pure stand-in for a simulation
        types = [topo.nodes[i].gpu_type for i in split.prefill]
        return 100 + sum(value.get(t, -2.0) for t in types)

    by_type = nodes_by_type(topo)

    def place(counts) -> SplitPlacement:  # which nodes prefill is all the stand-in score reads
        return SplitPlacement({i: (0, 80) for t, k in counts.items() for i in by_type[t][:k]}, {})

    res = search_split(topo, {"A100": 2, "L4x2": 3}, score, min_gain=0.0, max_candidates=40, place=place)
    assert res.counts["A100"] == 4 and "T4x2" not in res.counts
    assert res.score == max(s for _, s in res.tried)
