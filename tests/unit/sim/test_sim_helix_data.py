"""The simulator on the authors' data: scenario construction and a short smoke run."""

import pytest

from p2pserve.helix.root import data_root

DATA = data_root()  # the packaged copy unless $P2PSERVE_HELIX_DATA names another


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
    assert len(sc.graph.assignments) == 24 and sc.graph.covers_model()
    # KV capacities come from the layout's simulator_cluster.ini: node 0 is an L4 with 4 layers
    assert sc.graph.assignments[0].kv_capacity == 3004416


def test_separate_pipelines_never_cross_groups():
    from p2pserve.sim.scenario import build_scenario, helix_part

    lay = DATA / "layouts/single_cluster/llama70b/separate"
    parts = [helix_part(DATA / f"clusters/single_cluster/{t}.ini", lay / f"{t}_solution_file.ini")
             for t in ("a100", "l4", "t4")]
    sc = build_scenario("llama2-70b", parts)
    groups = sc.part_of
    for u, edges in sc.graph.out_edges.items():
        for e in edges:
            if u >= 0 and e.dst >= 0:
                assert groups[u] == groups[e.dst]
    assert sc.graph.assignments[0].kv_capacity == 491900  # from a100_simulator_cluster.ini


#: The authors' simulated decode throughput of their placement (cluster24, 70B, offline, IWRR).
PUBLISHED_OFFLINE = 252.1


def test_offline_run_reproduces_the_published_throughput():
    """Helix's offline window (60 s warm-up, 600 s; about 3 s of CPU) lands within 15 % of the
    authors' 252.1 tokens/s (264.9 with seed 0). A shorter window says nothing: the closed loop
    fills slowly, so 20 s + 20 s gives about 44 and 60 s + 60 s overshoots to about 390."""
    from p2pserve.sim.run import SimConfig, simulate

    off = simulate(helix_70b(), SimConfig(mode="offline", warmup=60.0, duration=600.0, seed=0))
    assert off.decode_throughput_tokens_per_s == pytest.approx(PUBLISHED_OFFLINE, rel=0.15)
    assert off.decode_latency_s.count > 0


def test_short_online_run():
    from p2pserve.sim.run import SimConfig, simulate

    on = simulate(helix_70b(), SimConfig(mode="online", warmup=0.0, duration=30.0, token_rate=700.0,
                                         scheduler="random"))
    assert on.queries_submitted > 5 and on.prompt_latency_s.count > 0


def test_cli_json(capfd):
    import argparse
    import json

    from p2pserve.cli import sim as command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    # Names relative to the data root's clusters/ and layouts/.
    args = parser.parse_args([
        "--cluster", "single_cluster/cluster24.ini", "--model", "llama2-70b",
        "--placement", "single_cluster/llama70b/ilp/ilp_sol.ini",
        "--mode", "online", "--rate", "700", "--duration", "20", "--warmup", "0", "--json",
    ])
    assert command.run(args) == 0
    out = json.loads(capfd.readouterr().out)
    assert out["decode_throughput_tokens_per_s"] > 0
    for key in ("prompt_latency_s", "decode_latency_s"):
        assert set(out[key]) >= {"mean", "p50", "p95"}
