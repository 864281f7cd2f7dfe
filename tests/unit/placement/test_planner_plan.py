"""Planner outputs: validity, memory errors, JSON/CLI shape, estimates."""

from __future__ import annotations

import json

import pytest

from p2pserve.helix import format as hf
from p2pserve.cli import plan as plan_command
from p2pserve.placement.estimate import estimate
from p2pserve.placement.heuristics import all_heuristics
from p2pserve.placement.planner import PlannerConfig, plan_for_topology
from p2pserve.placement.solution import validate_placement
from p2pserve.placement.search import balanced_chain
from p2pserve.helix.root import data_root
from p2pserve.errors import ConfigError, InsufficientMemoryError


def assert_valid(topo, assignments):
    covered = set()
    for i, (s, e) in assignments.items():
        assert 0 <= s < e <= topo.num_layers  # contiguous half-open range
        assert e - s <= topo.nodes[i].max_layers  # within memory
        covered |= set(range(s, e))
    assert covered == set(range(topo.num_layers))  # every layer served
    assert validate_placement(topo, assignments) == []


@pytest.mark.parametrize("objective", ["max-flow", "throughput"])
def test_plan_is_valid(cluster10, objective):
    plan = plan_for_topology(cluster10, PlannerConfig(objective=objective, time_limit_s=1.0))
    assert_valid(cluster10, plan.assignments)
    assert plan.max_flow > 0
    assert plan.max_flow <= plan.covering_bound + 1e-6 <= plan.upper_bound + 1e-6
    assert 0.0 <= plan.solver_gap < 1.0
    assert plan.estimate.decode_tokens_per_s > 0
    assert plan.estimate.mean_depth >= 1
    # flows conserve at every node
    for i in plan.assignments:
        inflow = sum(f for (u, v), f in plan.flows.items() if v == i)
        outflow = sum(f for (u, v), f in plan.flows.items() if u == i)
        assert inflow == pytest.approx(outflow, abs=1e-6)


def test_heuristics_are_valid(cluster24):
    for name, placement in all_heuristics(cluster24).items():
        assert_valid(cluster24, placement)
    assert_valid(cluster24, balanced_chain(cluster24))


def test_max_flow_objective_beats_helix_on_cluster10(cluster10):
    plan = plan_for_topology(cluster10, PlannerConfig(objective="max-flow", time_limit_s=1.0, use_milp=False))
    assert plan.max_flow >= 286.587 - 1e-3  # the authors' proven optimum


def test_insufficient_memory_says_how_much(cluster24):
    small, _ = cluster24.without(range(3, 24))  # 3 nodes left
    have = small.total_memory_layers()
    with pytest.raises(InsufficientMemoryError) as err:
        plan_for_topology(small, PlannerConfig(time_limit_s=1.0))
    msg = str(err.value)
    assert f"{80 - have} layers" in msg
    assert "GB" in msg and "missing" in msg


def test_depth_limit_is_respected(cluster10):
    plan = plan_for_topology(cluster10, PlannerConfig(time_limit_s=1.0, max_depth=8))
    assert plan.estimate.max_depth <= 8
    assert_valid(cluster10, plan.assignments)
    # 60 layers on nodes of at most 11 (L4) and 7 (T4) layers need 7 hops: 6 cannot be met.
    plan = plan_for_topology(cluster10, PlannerConfig(time_limit_s=1.0, max_depth=6))
    assert any("depth limit" in w for w in plan.warnings)


def test_config_validation():
    with pytest.raises(ConfigError):
        PlannerConfig(objective="fastest")
    with pytest.raises(ConfigError):
        PlannerConfig(time_limit_s=0)


def test_chain_estimate_is_worse_than_helix(cluster24):
    """The issue's point: the 24-hop chain has a higher max-flow but serves fewer tokens."""
    helix = hf.load_solution(data_root() / "layouts/single_cluster/llama70b/ilp/ilp_sol.ini")
    chain = balanced_chain(cluster24)
    e_helix, e_chain = estimate(cluster24, helix), estimate(cluster24, chain)
    assert e_chain.mean_depth == 24
    assert e_chain.decode_tokens_per_s < e_helix.decode_tokens_per_s
    assert e_chain.per_token_latency_s > e_helix.per_token_latency_s


def test_cli_json(capfd, tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    plan_command.add_arguments(parser)
    sol = tmp_path / "sol.ini"
    args = parser.parse_args([
        "--cluster", str(data_root() / "clusters/ablation/cluster10.ini"),
        "--model", "llama1-30b", "--time-limit", "1", "--objective", "max-flow", "--json",
        "--write-solution", str(sol),
    ])
    assert plan_command.run(args) == 0
    out = json.loads(capfd.readouterr().out)
    for key in ("max_flow_tokens_per_s", "upper_bound_tokens_per_s", "solve_time_s", "assignments"):
        assert key in out
    assert len(out["assignments"]) >= 1
    back = hf.load_solution(sol)
    assert {str(i): list(r) for i, r in back.items()} == out["assignments_by_index"]


def test_cli_reports_memory_error(capsys, tmp_path):
    import argparse

    ini = tmp_path / "tiny.ini"
    ini.write_text(
        "[NodeNames]\ntotal_compute_nodes=1\n[SourceNode]\nconnected_nodes=[0]\n"
        "[SinkNode]\nconnected_nodes=[0]\n[ComputeNode-0]\ntype=T4\nconnected_nodes=['source', 'sink']\n"
    )
    parser = argparse.ArgumentParser()
    plan_command.add_arguments(parser)
    args = parser.parse_args(["--cluster", str(ini), "--model", "llama2-70b", "--time-limit", "1"])
    assert plan_command.run(args) == 2
    assert "missing" in capsys.readouterr().err
