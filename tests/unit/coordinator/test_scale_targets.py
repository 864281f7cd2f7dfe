"""The coordinator's churn handling above a few dozen peers: keep a covering placement, re-solve
by cells and relabel otherwise."""

from __future__ import annotations

from p2pserve.coordinator.scale_targets import is_large, large_swarm_targets
from p2pserve.helix.scale import five_regions, scale_cluster
from p2pserve.helix.topology import topology_from_helix
from p2pserve.placement.moves import by_name
from p2pserve.placement.planner import PlannerConfig
from p2pserve.placement.scale import ScaleConfig, plan_at_scale
from p2pserve.placement.solution import validate_placement

FAST = ScaleConfig(first_work=20, cell_work=40)


def test_a_covered_large_swarm_keeps_every_target():
    topo = topology_from_helix(scale_cluster(five_regions(100), "g100", inter_sample=4), "llama2_70b")
    assert is_large(topo)
    current = by_name(topo, plan_at_scale(topo, PlannerConfig(), FAST).assignments)
    ids = [n.name for n in topo.nodes]
    out, method = large_swarm_targets(topo, ids, current, PlannerConfig(work=50))
    assert by_name(topo, out) == current and "0 layers" in method


def test_newcomers_get_a_relabelled_fresh_plan():
    topo = topology_from_helix(scale_cluster(five_regions(100), "g100", inter_sample=4), "llama2_70b")
    before, _ = topo.without([3, 40, 77])
    current = by_name(before, plan_at_scale(before, PlannerConfig(), FAST).assignments)
    ids = [n.name for n in topo.nodes]
    out, method = large_swarm_targets(topo, ids, current, PlannerConfig(work=50))
    assert validate_placement(topo, out) == []
    assert "relabelled" in method
    kept = sum(1 for name, r in by_name(topo, out).items() if current.get(name) == r)
    assert kept > 0  # interchangeable peers keep the ranges they hold
