"""Churn handling for swarms too large for the whole-swarm churn searches (pure, no I/O).

:mod:`p2pserve.placement.churn` re-solves the whole swarm on a join, a leave that uncovers a
layer or a periodic re-measure (a fresh solve, a cover MILP, annealing over every node): at a few
hundred peers each of those costs what a full solve of today's planner costs, minutes. Above
:attr:`~p2pserve.placement.scale.ScaleConfig.direct_nodes` peers the coordinator does this
instead:

* nobody new, no cells known and every layer still covered: keep every target (flows are
  recomputed over the served ranges as always; no layer loads);
* nobody new and the cells of the current plan known (``Plan.cells``):
  :func:`~p2pserve.placement.scale_churn.replan_after_leave`, which keeps every cell that still
  serves the whole model and repairs only the cells a leave broke, each charged the layers it
  loads (the fewest-moves trade of :mod:`p2pserve.placement.churn`, cell by cell); a cell that
  relied on other cells' peers for a layer would otherwise route across regions;
* otherwise (newcomers, or no cells known): a fresh
  :func:`~p2pserve.placement.scale.plan_at_scale`, relabelled onto the current placement so
  interchangeable peers keep the layers they hold
  (:func:`~p2pserve.placement.relabel.relabel_for_fewest_moves`).

Periodic re-measures therefore never move layers at this size while every cell is covered. Every
path returns the cells of the placement it returns, which the next plan carries.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, NamedTuple, Sequence

from p2pserve.placement.moves import by_index, by_name, layers_to_load
from p2pserve.placement.planner import PlannerConfig
from p2pserve.placement.relabel import relabel_for_fewest_moves
from p2pserve.placement.relabel import interchangeable_groups
from p2pserve.placement.scale import ScaleConfig, cells_by_name, plan_at_scale
from p2pserve.placement.scale_churn import replan_after_leave
from p2pserve.placement.solution import validate_placement
from p2pserve.placement.topology import Topology
from p2pserve.types import LayerRange


#: The share of a re-solve's time limit kept for relabelling the fresh plan onto the current one
#: (matching interchangeable peers, the cells that follow them): a few tenths of a second at 300
#: peers on a loaded machine, which a plan given the whole limit ran past it by.
RELABEL_SHARE = 0.1


def is_large(topo: Topology, scale: ScaleConfig = ScaleConfig()) -> bool:
    """Whether ``topo`` is planned by regions and cells rather than as one swarm."""
    return topo.num_nodes > scale.direct_nodes


class ScaleTargets(NamedTuple):
    """Targets (node index -> range), the method's text, and the cells (node names) they were
    planned in."""

    assignments: dict[int, tuple[int, int]]
    method: str
    cells: list[list[str]]


def large_swarm_targets(topo: Topology, ids: Sequence[str], current: Mapping[str, LayerRange],
                        config: PlannerConfig, cells: Sequence[Sequence[str]] = (),
                        reload_share: float = 0.01) -> ScaleTargets:
    """Targets for a large swarm with a current plan (see module docstring); ``cells``: the
    current plan's (names; departed peers may be in them)."""
    cur_idx = by_index(topo, current)
    newcomers = any(pid not in current for pid in ids)
    live = set(ids)
    kept_cells = [[x for x in c if x in live] for c in cells]
    kept_cells = [c for c in kept_cells if c]
    kept = ScaleTargets(dict(cur_idx), "kept: every layer covered (0 layers to load)", kept_cells)
    if not newcomers and live <= {x for c in kept_cells for x in c}:
        r = replan_after_leave(topo, dict(current), kept_cells, config, reload_share=reload_share)
        if r.layers_moved == 0 and not validate_placement(topo, cur_idx):
            return kept  # every cell still serves the whole model
        if not validate_placement(topo, r.plan.assignments):
            fixed = sum(1 for x in r.repairs if x.action == "repaired")
            return ScaleTargets(dict(r.plan.assignments), f"scale re-plan after leave: {fixed} cells repaired "
                                f"({r.layers_moved} layers to load)", kept_cells)
    elif not newcomers and not validate_placement(topo, cur_idx):
        return kept
    # the relabelling after the solve is part of the solve's limit: keep it a share
    fresh = plan_at_scale(topo, replace(config, time_limit_s=config.time_limit_s * (1.0 - RELABEL_SHARE)))
    relabelled = relabel_for_fewest_moves(topo, fresh.assignments, current)
    moved = layers_to_load(current, by_name(topo, relabelled))
    return ScaleTargets(relabelled, f"scale re-solve, relabelled ({moved} layers to load)",
                        relabelled_cells(topo, cells_by_name(fresh), fresh.assignments, relabelled))


def relabelled_cells(topo: Topology, cells: Sequence[Sequence[str]], before: Mapping[int, tuple[int, int]],
                     after: Mapping[int, tuple[int, int]]) -> list[list[str]]:
    """``cells`` of the placement ``before``, once relabelling (which swaps ranges only among
    interchangeable nodes) made it ``after``: a node takes the cell of the node whose range it took."""
    index = {n.name: i for i, n in enumerate(topo.nodes)}
    group = {i: g for g, members in enumerate(interchangeable_groups(topo)) for i in members}
    holders: dict[tuple, list[int]] = {}
    for i in sorted(range(topo.num_nodes), reverse=True):
        holders.setdefault((group[i], after.get(i)), []).append(i)
    out = []
    for c in cells:
        members = []
        for name in c:
            i = index[name]
            pool = holders.get((group[i], before.get(i)))
            members.append(topo.nodes[pool.pop()].name if pool else name)
        out.append(members)
    return out
