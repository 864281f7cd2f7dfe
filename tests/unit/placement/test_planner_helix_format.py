"""Helix artifact readers: cluster/solution parsing and the authors' T tables reproduce exactly."""

from __future__ import annotations

import pytest

from p2pserve.helix import format as hf
from p2pserve.helix.root import data_root
from p2pserve.helix.throughput import load_reference_throughput, node_throughput_tables


@pytest.fixture(scope="module")
def data():
    return data_root()


@pytest.mark.parametrize(
    "cluster,model,reference",
    [
        ("clusters/single_cluster/cluster24.ini", "llama2-70b", "single_cluster_llama70b"),
        ("clusters/ablation/cluster10.ini", "llama1-30b", "ablation_quality_cluster10"),
        ("clusters/single_cluster/a100.ini", "llama1-30b", "single_cluster_llama30b_a100"),
        ("clusters/single_cluster/l4.ini", "llama1-30b", "single_cluster_llama30b_l4"),
        ("clusters/single_cluster/t4.ini", "llama1-30b", "single_cluster_llama30b_t4"),
    ],
)
def test_throughput_tables_reproduce_authors(data, cluster, model, reference):
    ours = node_throughput_tables(hf.load_cluster(data / cluster), model)
    theirs = load_reference_throughput(reference)
    assert len(ours) == len(theirs)
    for row_ours, row_theirs in zip(ours, theirs):
        assert len(row_ours) == len(row_theirs)
        for a, b in zip(row_ours[1:], row_theirs[1:]):
            assert a == pytest.approx(b, rel=1e-9)


def test_cluster24_parse(data):
    c = hf.load_cluster(data / "clusters/single_cluster/cluster24.ini")
    assert c.num_nodes == 24
    assert sorted(set(c.node_types)) == ["A100", "L4", "T4"]
    assert c.node_types.count("A100") == 4 and c.node_types.count("T4") == 12
    assert len(c.links) == 24 * 23 // 2
    assert all(a < b for a, b in c.links)
    link = c.link(5, 3)
    assert link.bandwidth == pytest.approx(1e9) and link.latency_s == pytest.approx(1e-3)
    assert c.source_connected == list(range(24)) and len(c.source_links) == 24


def test_solution_parse(data):
    sol = hf.load_solution(data / "layouts/single_cluster/llama70b/ilp/ilp_sol.ini")
    assert len(sol) == 24
    assert sol[15] == (0, 3) and sol[4] == (77, 80)
    covered = set()
    for s, e in sol.values():
        covered |= set(range(s, e))
    assert covered == set(range(80))


def test_profile_interpolation():
    prof = hf.load_profile("llama2-70b", "A100")
    assert prof.prompt_ms(250) == pytest.approx(2.0)
    assert prof.prompt_ms(375) == pytest.approx(3.0)
    assert prof.decode_ms(0) == 0.0
    assert prof.decode_ms(1e6) > prof.decode_ms(400)  # extrapolates upward


def test_quantities():
    assert hf.parse_quantity("1000 * mbps") == pytest.approx(1e9)
    assert hf.parse_quantity("1 * MilliSec") == pytest.approx(1e-3)
    assert hf.parse_quantity("16 * GB") == pytest.approx(16e9)
