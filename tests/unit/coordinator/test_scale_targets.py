"""The coordinator's churn handling above a few dozen peers: keep a covering placement, re-solve
by cells and relabel otherwise."""

from __future__ import annotations

from p2pserve.coordinator.scale_targets import is_large, large_swarm_targets
from p2pserve.helix.scale import five_regions, scale_cluster
from p2pserve.helix.topology import topology_from_helix
from p2pserve.placement.moves import by_name, layers_to_load
from p2pserve.placement.planner import PlannerConfig
from p2pserve.placement.scale import ScaleConfig, cells_by_name, plan_at_scale
from p2pserve.placement.solution import validate_placement

FAST = ScaleConfig(first_work=20, cell_work=40)


def test_a_covered_large_swarm_keeps_every_target():
    topo = topology_from_helix(scale_cluster(five_regions(100), "g100", inter_sample=4), "llama2_70b")
    assert is_large(topo)
    current = by_name(topo, plan_at_scale(topo, PlannerConfig(), FAST).assignments)
    ids = [n.name for n in topo.nodes]
    out, method, _ = large_swarm_targets(topo, ids, current, PlannerConfig(work=50))
    assert by_name(topo, out) == current and "0 layers" in method


def test_newcomers_get_a_relabelled_fresh_plan():
    topo = topology_from_helix(scale_cluster(five_regions(100), "g100", inter_sample=4), "llama2_70b")
    before, _ = topo.without([3, 40, 77])
    current = by_name(before, plan_at_scale(before, PlannerConfig(), FAST).assignments)
    ids = [n.name for n in topo.nodes]
    out, method, _ = large_swarm_targets(topo, ids, current, PlannerConfig(work=50))
    assert validate_placement(topo, out) == []
    assert "relabelled" in method
    kept = sum(1 for name, r in by_name(topo, out).items() if current.get(name) == r)
    assert kept > 0  # interchangeable peers keep the ranges they hold


def test_a_leave_that_uncovers_a_layer_repairs_only_its_cells():
    topo = topology_from_helix(scale_cluster(five_regions(100), "g100", inter_sample=4), "llama2_70b")
    sol = plan_at_scale(topo, PlannerConfig(), FAST)
    current, cells = by_name(topo, sol.assignments), cells_by_name(sol)
    # every peer holding layer 0 in the first cell leaves
    gone = [x for x in cells[0] if current.get(x, (1, 1))[0] == 0]
    after, _ = topo.without([i for i, n in enumerate(topo.nodes) if n.name in gone])
    ids = [n.name for n in after.nodes]
    left = {k: v for k, v in current.items() if k in set(ids)}
    out, method, new_cells = large_swarm_targets(after, ids, left, PlannerConfig(work=50), cells)
    assert validate_placement(after, out) == [] and "re-plan after leave" in method
    moved = {name for name, r in by_name(after, out).items() if left.get(name) != r}
    assert moved and moved <= set(cells[0])  # only the damaged cell loads layers
    assert layers_to_load(left, by_name(after, out)) > 0
    assert sorted(x for c in new_cells for x in c) == sorted(ids)
