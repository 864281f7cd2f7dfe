"""The paper's geo-distributed and high-heterogeneity clusters (``p2pserve.helix.generate``):
the packaged files are what the generator writes, they load with the paper's composition and
links, and the planner places LLaMA-2-70B on them validly, in a few seconds each."""

from __future__ import annotations

from collections import Counter

import pytest

from p2pserve.helix import format as hf
from p2pserve.helix.generate import GENERATED
from p2pserve.helix.root import data_root
from p2pserve.helix.topology import load_helix_topology
from p2pserve.placement.planner import PlannerConfig, plan_for_topology
from p2pserve.placement.solution import validate_placement
from p2pserve.sim.scenario import Part, build_scenario

GEO = "distributed/cluster24_geo.ini"
HETERO = "heterogeneity/cluster42.ini"


@pytest.mark.parametrize("rel", sorted(GENERATED))
def test_packaged_file_is_what_the_generator_writes(rel):
    assert (data_root() / "clusters" / rel).read_text() == GENERATED[rel]()


def test_geo_cluster_has_three_regions_and_slow_links_between_them():
    c = hf.load_cluster(data_root() / "clusters" / GEO)
    assert Counter(c.node_types) == {"A100": 4, "L4": 8, "T4": 12}
    assert len(c.links) == 24 * 23 // 2
    region = [0] * 4 + [1] * 10 + [2] * 10
    for (a, b), link in c.links.items():
        same = region[a] == region[b]
        assert (link.bandwidth, link.latency_s) == ((1e9, 1e-3) if same else (1e8, 0.05))
    assert c.source_links[0].latency_s == 1e-3 and c.source_links[23].latency_s == 0.05


def test_hetero_cluster_has_the_papers_42_nodes():
    c = hf.load_cluster(data_root() / "clusters" / HETERO)
    assert Counter(c.node_types) == {"A100": 4, "V100": 6, "L4": 8, "T4": 10, "L4x2": 4, "T4x2": 6, "T4x4": 4}


@pytest.mark.parametrize("rel", [GEO, HETERO])
@pytest.mark.parametrize("objective", ["throughput", "max-flow"])
def test_planner_places_70b_validly(rel, objective):
    path = data_root() / "clusters" / rel
    topo = load_helix_topology(path, "llama2-70b")
    plan = plan_for_topology(topo, PlannerConfig(objective=objective, work=300, time_limit_s=120, seed=0))
    assert not validate_placement(topo, plan.assignments)
    assert plan.max_flow > 0
    # and the simulator accepts it (a source-to-sink path through all 80 layers)
    sc = build_scenario("llama2-70b", [Part(hf.load_cluster(path), dict(plan.assignments))])
    assert sc.graph.covers_model()
