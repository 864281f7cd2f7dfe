"""The leader's decision, pure: given a snapshot of the swarm, whether to re-plan, and which
Plan record (with which epoch) to publish. No asyncio, no hivemind: the service runs
:func:`replan` once per round and does the I/O around it.

Epochs: a new leader (or one that saw a higher epoch from someone else) publishes above every
epoch it has seen; afterwards the epoch only moves when the plan's content changes
(:func:`~p2pserve.coordinator.plan_record.plan_changed`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from p2pserve.config import CoordinatorConfig
from p2pserve.coordinator.plan_record import make_plan, plan_changed, with_epoch
from p2pserve.coordinator.snapshot import Snapshot, Summary
from p2pserve.coordinator.trigger import Reason, Trigger
from p2pserve.dht.election import next_epoch
from p2pserve.dht.records import Plan
from p2pserve.placement.guard import CheckFactory


def decide_replan(
    prev: Optional[Summary], cur: Summary, now: float, last_plan_at: Optional[float], cfg: CoordinatorConfig
) -> Optional[Reason]:
    """Why to re-plan now, or ``None`` to keep the current plan (refreshing it is separate).

    Re-plans on: no plan yet, a peer joined or left, a peer flipped to another served range,
    a link whose bandwidth changed by more than ``link_change_threshold`` (relative) or appeared,
    and every ``replan_period``. A link that read faster than ``link_ceiling`` both times cannot
    limit any flow, so its changes are noise to the planner (a fast link's probe reading
    jitters a lot and would otherwise trigger a full solve every few seconds).
    """
    if prev is None or last_plan_at is None:
        return Reason(Trigger.INITIAL)
    joined = cur.peers - prev.peers
    left = prev.peers - cur.peers
    if joined or left:
        parts = []
        if joined:
            parts.append("join " + ",".join(sorted(p[-8:] for p in joined)))
        if left:
            parts.append("leave " + ",".join(sorted(p[-8:] for p in left)))
        return Reason(Trigger.MEMBERSHIP, "; ".join(parts))
    if cur.spans != prev.spans:
        return Reason(Trigger.SERVED_RANGES)
    for k, bw in cur.bandwidth.items():
        old = prev.bandwidth.get(k)
        if old is not None and min(bw, old) > cur.link_ceiling:
            continue
        if old is None or abs(bw - old) > cfg.link_change_threshold * max(old, 1e-9):
            return Reason(Trigger.LINK, f"link {k[0][-6:]}->{k[1][-6:]} changed")
    if now - last_plan_at >= cfg.replan_period:
        return Reason(Trigger.PERIODIC)
    return None


@dataclass(frozen=True)
class LeaderState:
    """What a coordinator remembers between rounds to decide the next one."""

    plan: Optional[Plan] = None  # the plan this node last published
    summary: Optional[Summary] = None  # the swarm as of the last re-plan
    planned_at: Optional[float] = None  # when that re-plan ran


@dataclass(frozen=True)
class Decision:
    """The outcome of one round: the state to keep, why it re-planned, what to publish."""

    state: LeaderState
    reason: Optional[Reason] = None  # None: nothing triggered a re-plan
    publish: Optional[Plan] = None  # a plan under a new epoch; None: keep (and refresh) the current one
    solve_s: Optional[float] = None  # how long the re-plan took, when one ran (published or not)


def why_replan(
    state: LeaderState, summary: Summary, *, elected: bool, latest_seen: Optional[Plan], now: float,
    cfg: CoordinatorConfig,
) -> Optional[Reason]:
    """Why the leader re-plans this round: it just took the lead, someone published a higher
    epoch than ours, or :func:`decide_replan` says the swarm changed enough."""
    if elected:
        return Reason(Trigger.ELECTED)
    if latest_seen is not None and state.plan is not None and latest_seen.epoch > state.plan.epoch:
        return Reason(Trigger.SAW_EPOCH, f"saw epoch {latest_seen.epoch} from {latest_seen.leader_id}")
    return decide_replan(state.summary, summary, now, state.planned_at, cfg)


def replan(
    snap: Snapshot,
    state: LeaderState,
    *,
    elected: bool,
    latest_seen: Optional[Plan],
    now: float,
    cfg: CoordinatorConfig,
    leader_id: str,
    model: str,
    plan_check: Optional[CheckFactory] = None,
) -> Decision:
    """One leader round: decide whether to re-plan and which plan to publish.

    ``elected``: this node was not the leader last round. ``latest_seen``: the highest-epoch
    trusted plan any coordinator published. The new plan continues from the newest placement
    (ours or ``latest_seen``), so a takeover reloads nothing. May run a placement solve
    (seconds): the service calls it off its event loop. ``plan_check``: see
    :func:`~p2pserve.coordinator.plan_record.make_plan`.
    """
    summary = Summary.of(snap, cfg.activation_bytes)
    reason = why_replan(state, summary, elected=elected, latest_seen=latest_seen, now=now, cfg=cfg)
    if reason is None:
        return Decision(state)
    basis = state.plan
    if latest_seen is not None and (basis is None or latest_seen.epoch > basis.epoch):
        basis = latest_seen
    plan = make_plan(snap, basis.targets if basis else {}, epoch=0, leader_id=leader_id, model=model, cfg=cfg,
                     reason=reason, now=now, plan_check=plan_check, cells=basis.cells if basis else {})
    state = replace(state, summary=summary, planned_at=now)
    if not (reason.trigger.bumps_epoch or plan_changed(state.plan, plan)):
        return Decision(state, reason, solve_s=plan.solve_time)
    seen = [p.epoch for p in (latest_seen, state.plan) if p is not None]
    plan = with_epoch(plan, next_epoch(seen, now))
    return Decision(replace(state, plan=plan), reason, plan, plan.solve_time)
