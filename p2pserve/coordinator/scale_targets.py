"""Churn handling for swarms too large for the whole-swarm churn searches (pure, no I/O).

:mod:`p2pserve.placement.churn` re-solves the whole swarm on a join, a leave that uncovers a
layer or a periodic re-measure (a fresh solve, a cover MILP, annealing over every node): at a few
hundred peers each of those costs what a full solve of today's planner costs, minutes. Above
:attr:`~p2pserve.placement.scale.ScaleConfig.direct_nodes` peers the coordinator does this
instead:

* every layer still covered and nobody new: keep every target (flows are recomputed over the
  served ranges as always; no layer loads);
* otherwise: a fresh :func:`~p2pserve.placement.scale.plan_at_scale`, relabelled onto the current
  placement so interchangeable peers keep the layers they hold
  (:func:`~p2pserve.placement.relabel.relabel_for_fewest_moves`).

Periodic re-measures therefore never move layers at this size while the swarm is covered. The
cell-by-cell repair of :mod:`p2pserve.placement.scale_churn` needs the cells of the plan being
repaired, which the coordinator does not keep between rounds yet.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from p2pserve.placement.moves import by_index, by_name, layers_to_load
from p2pserve.placement.planner import PlannerConfig
from p2pserve.placement.relabel import relabel_for_fewest_moves
from p2pserve.placement.scale import ScaleConfig, plan_at_scale
from p2pserve.placement.solution import validate_placement
from p2pserve.placement.topology import Topology
from p2pserve.types import LayerRange


def is_large(topo: Topology, scale: ScaleConfig = ScaleConfig()) -> bool:
    """Whether ``topo`` is planned by regions and cells rather than as one swarm."""
    return topo.num_nodes > scale.direct_nodes


def large_swarm_targets(topo: Topology, ids: Sequence[str], current: Mapping[str, LayerRange],
                        config: PlannerConfig) -> tuple[dict[int, tuple[int, int]], str]:
    """Targets (node index -> range) and the method text for a large swarm with a current plan."""
    cur_idx = by_index(topo, current)
    newcomers = any(pid not in current for pid in ids)
    if not newcomers and not validate_placement(topo, cur_idx):
        return dict(cur_idx), "kept: every layer covered (0 layers to load)"
    fresh = plan_at_scale(topo, config)
    relabelled = relabel_for_fewest_moves(topo, fresh.assignments, current)
    moved = layers_to_load(current, by_name(topo, relabelled))
    return relabelled, f"scale re-solve, relabelled ({moved} layers to load)"
