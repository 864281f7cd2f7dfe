"""HexGen's "without asymmetric parallelism" baseline: pipelines of equal stages (pure).

HexGen's ablation (§5.2) compares its asymmetric layouts with a *symmetric* one: every pipeline
stage has the same TP degree and the same number of layers, as in Megatron-style PP x TP, while
the replicas are still placed by its search. Ours places layers per node freely (the planner's
asymmetric layer counts), so the symmetric baseline is built here instead:

* every machine runs groups of one degree ``d`` (:func:`~p2pserve.placement.grouping.fixed_grouping`);
* a pipeline is ``s`` groups of degree ``d``, each holding ``L / s`` consecutive layers, so ``s``
  divides the model's layers and every stage's group must hold ``L / s`` layers;
* pipelines are formed inside one region (HexGen avoids cross-region stages; machines with no
  region, as in the §3.1 case study, share one), from groups in machine order; groups left over
  in a region, or of another degree (a 3-GPU box at ``d = 2`` runs ``(2, 1)``), stay idle.

:func:`symmetric_layouts` lists every feasible ``(d, s)`` layout; a benchmark simulates them and
keeps the best, as HexGen's search would. :func:`challenge_with_symmetric` offers them to the
grouping search as challengers under its own score: HexGen's search space holds symmetric layouts
too, and ours places layers for throughput, which an SLO can rank below equal stages
(docs/hexgen.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

from p2pserve.placement.grouping import GroupingConfig, GroupingResult, Score, groups_of, uniform_choices
from p2pserve.placement.machines import Group, MachineCluster, group_topology
from p2pserve.placement.planner import make_solution
from p2pserve.placement.topology import Topology


@dataclass(frozen=True)
class SymmetricLayout:
    """``pipelines`` replicas of ``stages`` TP-``degree`` groups holding ``L / stages`` layers each."""

    degree: int
    stages: int
    choice: tuple[tuple[int, ...], ...]
    groups: list[Group]
    topology: Topology
    placement: dict[int, tuple[int, int]]

    @property
    def pipelines(self) -> int:
        """Replicas of the model: every placed group is one stage of one pipeline."""
        return len(self.placement) // self.stages

    @property
    def label(self) -> str:
        """Its key in a search's ``tried``: ``"symmetric tp<degree> x <stages>"``."""
        return f"symmetric tp{self.degree} x {self.stages}"


def symmetric_placement(cluster: MachineCluster, groups: list[Group], topo: Topology, degree: int,
                        stages: int) -> dict[int, tuple[int, int]]:
    """Node index -> layer range for pipelines of ``stages`` equal stages (empty if none fits)."""
    layers = topo.num_layers
    if stages < 1 or layers % stages:
        return {}
    per = layers // stages
    by_region: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        if g.d == degree and topo.nodes[i].max_layers >= per:
            by_region.setdefault(cluster.machines[g.machine].region, []).append(i)
    placement: dict[int, tuple[int, int]] = {}
    for nodes in by_region.values():
        for p in range(len(nodes) // stages):
            for j, i in enumerate(nodes[p * stages:(p + 1) * stages]):
                placement[i] = (j * per, (j + 1) * per)
    return placement


def symmetric_layouts(cluster: MachineCluster, config: GroupingConfig | None = None,
                      max_stage_counts: int = 3) -> list[SymmetricLayout]:
    """Feasible symmetric layouts: per uniform degree, the ``max_stage_counts`` smallest stage
    counts that form at least one pipeline (more stages than needed only lengthen the route)."""
    config = config or GroupingConfig()
    out: list[SymmetricLayout] = []
    layers = cluster.model.num_layers
    for d, choice in uniform_choices(cluster, config).items():
        groups = groups_of(cluster, choice)
        topo = group_topology(cluster, groups)
        found = 0
        for s in (x for x in range(1, layers + 1) if layers % x == 0):
            placement = symmetric_placement(cluster, groups, topo, d, s)
            if not placement:
                continue
            out.append(SymmetricLayout(d, s, choice, groups, topo, placement))
            found += 1
            if found >= max_stage_counts:
                break
    return out


def challenge_with_symmetric(cluster: MachineCluster, result: GroupingResult, config: GroupingConfig,
                             score: Score, layouts: list[SymmetricLayout] | None = None,
                             clock: Callable[[], float] = time.perf_counter) -> GroupingResult:
    """``result`` (``plan_grouping``'s), or the symmetric layout that ``score`` rates above it.

    Each layout is scored once, by the score the search used (pass the same object: a stateful
    score such as ``slo_score`` then probes a challenger at the search's best rate first), and
    recorded in ``tried`` under its ``label``. The search's result stays on a tie. A
    winning layout's solution is the planner's wrapper of its placement (``make_solution``:
    flows, bounds, estimate), with method ``"symmetric"``; ``solve_time_s`` adds the challenge's."""
    t0 = clock()
    tried, best, best_value = dict(result.tried), None, result.score
    for lay in layouts if layouts is not None else symmetric_layouts(cluster, config):
        sol = make_solution(lay.topology, lay.placement, config.planner, 0.0, "symmetric")
        value = tried[lay.label] = score(lay.topology, sol)
        if value > best_value + 1e-9:
            best, best_value = (lay, sol), value
    timing = {"tried": tried, "solve_time_s": result.solve_time_s + clock() - t0}
    if best is None:
        return replace(result, **timing)
    lay, sol = best
    return replace(result, choice=lay.choice, groups=lay.groups, topology=lay.topology, solution=sol,
                   score=best_value, **timing)
