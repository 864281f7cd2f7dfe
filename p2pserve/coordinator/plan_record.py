"""The Plan record a leading coordinator publishes: targets, flows, bounds (pure, no I/O).

Targets come from :func:`~p2pserve.coordinator.targets.plan_targets` over plannable peers;
flows always come from ``maxflow.max_flow`` over the ranges peers *serve now* (cell by cell in
a swarm planned in cells), never over targets, so a client following them only reaches loaded
ranges.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Optional

import msgspec

from p2pserve import clock as clocks
from p2pserve.clock import Clock
from p2pserve.config import CoordinatorConfig
from p2pserve.coordinator.snapshot import Snapshot
from p2pserve.coordinator.targets import build_topology, plan_targets
from p2pserve.coordinator.trigger import Reason
from p2pserve.dht.records import Flow, Plan
from p2pserve.placement.guard import CheckFactory
from p2pserve.placement.maxflow import max_flow
from p2pserve.placement.stitch import cell_flows
from p2pserve.types import SINK, SINK_INDEX, SOURCE, SOURCE_INDEX, LayerRange


def compute_flows(snap: Snapshot, cfg: CoordinatorConfig, cells: Mapping[str, str] = {}
                  ) -> tuple[list[Flow], float, float, dict[str, LayerRange], list]:
    """Max-flow over the ranges peers serve now: (flows, value, upper bound, spans, defaulted).

    ``cells`` (peer id -> cell, the plan the peers loaded for): a swarm planned in cells routes
    inside them, as it was planned (:func:`~p2pserve.placement.stitch.cell_flows`); without cells
    (a swarm planned whole), one max-flow over every served range.
    """
    spans = {pid: span for pid, span in snap.serving_now().items() if pid in set(snap.plannable())}
    ids = sorted(spans)
    if not ids:
        return [], 0.0, 0.0, {}, []
    topo, defaulted = build_topology(snap, ids, cfg)
    placement = {i: spans[pid] for i, pid in enumerate(ids)}
    groups = cell_lists({pid: cells[pid] for pid in ids if pid in cells})
    if groups:
        index = {pid: i for i, pid in enumerate(ids)}
        result = cell_flows(topo, placement, [[index[pid] for pid in g] for g in groups])
    else:
        result = max_flow(topo, placement)

    def name(i: int) -> str:
        return SOURCE if i == SOURCE_INDEX else SINK if i == SINK_INDEX else ids[i]

    flows = [Flow(name(u), name(v), float(f)) for (u, v), f in sorted(result.edge_flows.items(), key=lambda kv: (name(kv[0][0]), name(kv[0][1])))]
    return flows, float(result.value), float(topo.upper_bound()), spans, defaulted


#: The planner's share of the solve's limit it keeps however long the rest of the solve took
#: (a valid plan needs some search; the cells' first pass is not cut by the limit anyway).
MIN_PLANNER_SHARE = 0.25


def planner_limit(limit_s: float, spent_s: float, floor_share: float = MIN_PLANNER_SHARE) -> float:
    """Seconds left to the planner of a solve limited to ``limit_s`` once ``spent_s`` went to the
    rest of it (reading the topology, the flows), never below ``floor_share`` of the limit."""
    return max(floor_share * limit_s, limit_s - spent_s)


def make_plan(
    snap: Snapshot,
    current_targets: Mapping[str, LayerRange],
    *,
    epoch: int,
    leader_id: str,
    model: str,
    cfg: CoordinatorConfig,
    reason: Reason,
    now: float,
    clock: Clock = clocks.monotonic,
    plan_check: Optional[CheckFactory] = None,
    cells: Mapping[str, str] = {},
) -> Plan:
    """A complete Plan: targets over plannable peers, flows over served ranges.

    ``Plan.reason`` is the reason's text and, when the planner ran, the method it used;
    ``clock`` times the solve. ``plan_check`` builds the publish guard's check from the round's
    topology (None, or a factory returning None for it: the planner runs without the guard).
    ``cells``: the current plan's (``Plan.cells``), which a large swarm's re-plan after a leave
    repairs cell by cell; the new plan carries the cells of its own placement.
    """
    t0 = clock()
    ids = snap.plannable()
    targets: dict[str, LayerRange] = {}
    cell_of: dict[str, str] = {}
    defaulted_t: list = []
    text = str(reason)
    # Flows depend on what peers serve now, not on the targets: first, so the planner gets what is
    # left of the limit (topologies and flows: a second or more at 1,000 peers on a loaded machine).
    flows, value, bound, spans, defaulted_f = compute_flows(snap, cfg, cells)
    if ids:
        topo, defaulted_t = build_topology(snap, ids, cfg)
        current = _current(snap, ids, current_targets)
        check = plan_check(topo) if plan_check is not None else None
        left = planner_limit(cfg.solve_time_limit, clock() - t0)
        targets, method, new_cells = plan_targets(topo, ids, current, replace(cfg, solve_time_limit=left),
                                                  reason.trigger, check=check, cells=cell_lists(cells))
        text = f"{text}; {method}"
        cell_of = {pid: f"c{k}" for k, members in enumerate(new_cells) for pid in members}
    # the bound of the *target* placement is the meaningful one: what the swarm could reach
    if ids:
        bound = max(bound, topo.upper_bound())  # pyright: ignore[reportPossiblyUnboundVariable] (set when ids)
    defaulted = sorted(set(map(tuple, defaulted_t)) | set(map(tuple, defaulted_f)))
    return Plan(
        model=model,
        epoch=epoch,
        leader_id=leader_id,
        num_layers=cfg.num_layers,
        targets=targets,
        spans=spans,
        flows=flows,
        max_flow=value,
        upper_bound=bound,
        solve_time=clock() - t0,
        defaulted_links=defaulted,
        created_at=now,
        reason=text,
        cells=cell_of,
    )


def _current(snap: Snapshot, ids, current_targets: Mapping[str, LayerRange]) -> dict[str, LayerRange]:
    """Each peer's current range: its target, else (new leader, rejoin) what it already loads or serves."""
    current = {}
    for pid in ids:
        p = snap.peers[pid]
        span = current_targets.get(pid) or p.loading or p.serving
        if span is not None:
            current[pid] = span
    return current


def cell_lists(cells: Mapping[str, str]) -> list[list[str]]:
    """``Plan.cells`` (peer id -> cell name) as lists of peer ids, one per cell, in name order."""
    out: dict[str, list[str]] = {}
    for pid in sorted(cells):
        out.setdefault(cells[pid], []).append(pid)
    return [out[c] for c in sorted(out)]


def plan_changed(old: Optional[Plan], new: Plan, rel_tol: float = 0.01) -> bool:
    """Whether ``new`` differs from ``old`` enough to deserve a new epoch."""
    if old is None:
        return True
    if old.targets != new.targets or old.spans != new.spans:
        return True
    a = {(f.src, f.dst): f.rate for f in old.flows}
    b = {(f.src, f.dst): f.rate for f in new.flows}
    if a.keys() != b.keys():
        return True
    return any(abs(a[k] - b[k]) > rel_tol * max(a[k], b[k], 1e-9) for k in a)


def with_epoch(plan: Plan, epoch: int) -> Plan:
    """The same plan under another epoch."""
    return msgspec.structs.replace(plan, epoch=epoch)
