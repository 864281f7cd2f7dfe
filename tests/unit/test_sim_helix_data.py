"""The simulator on the authors' data: scenario construction and a short smoke run."""

import pytest

from p2pserve.helix.format import helix_data_dir
from p2pserve.errors import ConfigError

try:
    DATA = helix_data_dir()
except ConfigError:  # pragma: no cover - data missing in this checkout
    DATA = None

pytestmark = pytest.mark.skipif(DATA is None, reason="Helix artifact data not available")


def helix_70b():
    from p2pserve.sim.scenario import build_scenario, helix_part

    return build_scenario(
        "llama2-70b",
        [helix_part(DATA / "clusters/single_cluster/cluster24.ini",
                    DATA / "layouts/single_cluster/llama70b/ilp/ilp_sol.ini")],
    )


def test_helix_placement_scenario_matches_the_authors_max_flow():
    sc = helix_70b()
    assert sc.flow_value == pytest.approx(1289.56, abs=0.05)
    assert len(sc.topology.nodes) == 24 and sc.topology.covers_model()
    # KV capacities come from the layout's simulator_cluster.ini: node 0 is an L4 with 4 layers
    assert sc.topology.nodes[0].kv_capacity == 3004416


def test_separate_pipelines_never_cross_groups():
    from p2pserve.sim.scenario import build_scenario, helix_part

    lay = DATA / "layouts/single_cluster/llama70b/separate"
    parts = [helix_part(DATA / f"clusters/single_cluster/{t}.ini", lay / f"{t}_solution_file.ini")
             for t in ("a100", "l4", "t4")]
    sc = build_scenario("llama2-70b", parts)
    groups = {i: n.group for i, n in sc.topology.nodes.items()}
    for u, edges in sc.topology.out_edges.items():
        for e in edges:
            if u >= 0 and e.dst >= 0:
                assert groups[u] == groups[e.dst]
    assert sc.topology.nodes[0].kv_capacity == 491900  # from a100_simulator_cluster.ini


def test_short_offline_and_online_runs():
    from p2pserve.sim.run import SimConfig, simulate

    sc = helix_70b()
    off = simulate(sc, SimConfig(mode="offline", warmup=20.0, duration=20.0))
    assert off.decode_throughput_tokens_per_s > 50 and off.decode_latency_s.count > 0
    on = simulate(sc, SimConfig(mode="online", warmup=0.0, duration=30.0, token_rate=700.0, scheduler="random"))
    assert on.queries_submitted > 5 and on.prompt_latency_s.count > 0


def test_cli_json(capsys):
    import argparse
    import json

    from p2pserve.cli import sim as command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args([
        "--cluster", str(DATA / "clusters/single_cluster/cluster24.ini"), "--model", "llama2-70b",
        "--placement", str(DATA / "layouts/single_cluster/llama70b/ilp/ilp_sol.ini"),
        "--mode", "online", "--rate", "700", "--duration", "20", "--warmup", "0", "--json",
    ])
    assert command.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["decode_throughput_tokens_per_s"] >= 0
    for key in ("prompt_latency_s", "decode_latency_s"):
        assert set(out[key]) >= {"mean", "p50", "p95"}
