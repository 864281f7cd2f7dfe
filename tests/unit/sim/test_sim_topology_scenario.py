"""A simulation built from the planner's Topology alone (what a coordinator has for a live swarm)
is the simulation built from the Helix cluster file, and refuses nodes it cannot simulate."""

from __future__ import annotations

from dataclasses import replace

import pytest

from p2pserve.errors import ConfigError
from p2pserve.helix import format as hf
from p2pserve.helix.root import data_root
from p2pserve.helix.topology import load_helix_topology
from p2pserve.sim.plan_check import simulable, simulated_decode, topology_check
from p2pserve.sim.run import SimConfig, simulate
from p2pserve.sim.scenario import topology_scenario

C24 = "clusters/single_cluster/cluster24.ini"
HELIX = "layouts/single_cluster/llama70b/ilp/ilp_sol.ini"


@pytest.fixture(scope="module")
def c24():
    root = data_root()
    return load_helix_topology(root / C24, "llama2-70b"), hf.load_cluster(root / C24), hf.load_solution(root / HELIX)


def test_topology_scenario_is_the_cluster_file_scenario(c24):
    """Same KV, caps (A100s take 3 prompts a batch), latencies, flows: the same run, event for event."""
    topo, cluster, helix = c24
    from_file = simulated_decode(cluster, "llama2-70b", helix, duration=60.0, warmup=20.0, seed=3)
    check = topology_check(topo, duration=60.0, warmup=20.0, seed=3, throttle=False)  # as the file run: Helix caps
    assert simulable(topo)
    assert check(helix) == pytest.approx(from_file, rel=1e-12)
    assert from_file > 100


def test_topology_scenario_refuses_what_it_cannot_simulate(c24):
    """A node without a profile or KV capacity (a live peer that announced no profile) is refused
    with a typed error, and ``simulable`` says so beforehand."""
    topo, _, helix = c24
    bare = replace(topo, nodes=tuple(replace(n, profile=None) if i == 0 else n for i, n in enumerate(topo.nodes)))
    assert not simulable(bare)
    with pytest.raises(ConfigError, match="cannot be simulated"):
        topology_scenario(bare, helix)
    with pytest.raises(ConfigError, match="no source-to-sink path"):
        topology_scenario(topo, {i: r for i, r in helix.items() if r[0] != 0})


def test_topology_scenario_runs_the_live_shape(c24):
    """Caps absent (live peers announce no prompt cap): one prompt per batch, decode uncapped."""
    topo, _, helix = c24
    plain = replace(topo, nodes=tuple(replace(n, prompt_max_requests=(), decode_max_tokens=()) for n in topo.nodes))
    sc = topology_scenario(plain, helix)
    assert all(a.caps.prompt_max_requests == 1 for a in sc.graph.assignments.values())
    res = simulate(sc, SimConfig(duration=30.0, warmup=10.0, seed=0))
    assert res.decode_throughput_tokens_per_s > 0
