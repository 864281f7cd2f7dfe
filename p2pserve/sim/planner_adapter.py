"""Get a placement from our planner (``p2pserve.coordinator``) for ``--placement planner``.

The coordinator owns planning; this module only calls it. It prefers the planner's entry point
(``p2pserve.placement.planner.plan_for_topology``) when the checkout has one, else composes the
coordinator's public pieces the way DESIGN.md §3 describes: heuristic warm starts (Petals-greedy,
Swarm-even, separate pipelines, balanced chains) improved by the coordinator's seeded annealing
search, scored by its decode-throughput estimate (``coordinator.estimate``) when present, else by
max-flow.
"""

from __future__ import annotations

import importlib

from p2pserve.helix import format as hf


def plan_placement(
    cluster: hf.HelixCluster, model: str, time_limit_s: float = 20.0, seed: int = 0
) -> dict[int, tuple[int, int]]:
    """A placement ``{node: (start, end)}`` for ``cluster`` from the coordinator's planner."""
    from p2pserve.placement.topology import topology_from_helix

    topo = topology_from_helix(cluster, model)
    entry = _planner_entry()
    if entry is not None:
        return dict(entry(topo, time_limit_s=time_limit_s, seed=seed))
    from p2pserve.placement.heuristics import all_heuristics
    from p2pserve.placement.search import improve, max_flow_score

    starts = list(all_heuristics(topo).values())
    score = _estimate_score(topo) or max_flow_score(topo)
    best, _stats = improve(topo, starts, score, time_limit_s, seed=seed)
    return dict(best)


def _estimate_score(topo):
    """Score = the coordinator's decode-throughput estimate, if the module exists."""
    try:
        from p2pserve.placement.estimate import estimate
    except ImportError:
        return None

    def score(p):
        return estimate(topo, p).decode_tokens_per_s

    return score


def _planner_entry():
    """The planner's ``plan_for_topology(topo, time_limit_s=, seed=)`` if it exists."""
    try:
        mod = importlib.import_module("p2pserve.placement.planner")
    except ImportError:
        return None
    return getattr(mod, "plan_for_topology", None)
