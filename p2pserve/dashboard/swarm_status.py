"""The swarm's status as one JSON-ready dict: what ``p2pserve status`` prints and what
``/api/swarm`` (:mod:`p2pserve.dashboard.document`) builds on. Pure: records in, dict out.

Peers (state, served and loading range, device, version, decode throughput at the served size,
KV load, claimed vs effective rate and why it is capped), measured links, coordinators and the
elected leader, the followed plan (epoch, targets, max-flow, upper bound) and its flows, and the
verification evidence with the exclusions it causes.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from p2pserve.config import CoordinatorConfig
from p2pserve.coordinator import claims
from p2pserve.dht.election import SignedPlan, elect_leader
from p2pserve.dht.records import CoordinatorCandidate, LinkInfo, PeerInfo
from p2pserve.dht.reports import ServiceReports


def _span(s) -> Optional[list[int]]:
    return None if s is None else [int(s[0]), int(s[1])]


def _peer_row(p: PeerInfo, plan: Optional[SignedPlan], now: float, verdict: claims.Verdict) -> dict[str, Any]:
    """One peer's entry of :func:`collect_status` (``start``/``end``: the served range, or None)."""
    return {
        "peer_id": p.peer_id,
        # "loading (handover)": loaded, waiting for its dropped layers to be covered
        "state": f"{p.state} (handover)" if p.state == "loading" and p.loaded else p.state,
        "start": int(p.serving[0]) if p.serving else None,
        "end": int(p.serving[1]) if p.serving else None,
        "serving": _span(p.serving),
        "loading": _span(p.loading),
        "target": _span(plan.plan.targets.get(p.peer_id)) if plan else None,
        "device": p.device,
        "version": p.version,
        "max_layers": p.max_layers,
        "decode_tps": p.decode_rate(p.serving[1] - p.serving[0]) if p.serving else None,
        "claimed_tps": verdict.claimed,
        "effective_tps": verdict.effective,
        "claim": verdict.describe(),
        "kv_free_tokens": p.kv_free_tokens,
        "queued_tokens": p.queued_tokens,
        "relayed": p.relayed,
        "age_s": round(max(0.0, now - p.timestamp), 2),
    }


def _plan_status(plan: SignedPlan, now: float) -> dict[str, Any]:
    p = plan.plan
    cover = p.coverage()
    return {
        "epoch": p.epoch,
        "leader_id": p.leader_id,
        "reason": p.reason,
        "age_s": round(max(0.0, now - p.created_at), 2),
        "num_layers": p.num_layers,
        "uncovered_layers": [i for i, c in enumerate(cover) if c == 0],
        "max_flow": p.max_flow,
        "upper_bound": p.upper_bound,
        "solve_time_s": p.solve_time,
        "defaulted_links": [list(x) for x in p.defaulted_links],
        "flows": [{"src": f.src, "dst": f.dst, "tokens_per_s": f.rate} for f in p.flows],
    }


def collect_status(
    peers: dict[str, PeerInfo],
    links: list[LinkInfo],
    candidates: list[CoordinatorCandidate],
    plan: Optional[SignedPlan],
    now: float,
    reports: Sequence[ServiceReports] = (),
    evidence: Optional[list] = None, trusted_verifiers: tuple[str, ...] = (),
) -> dict[str, Any]:
    """A JSON-ready description of the swarm (``reports``: clients' observed service rates, from
    which each peer's claimed and effective one-layer rate are judged as a coordinator with the
    default claims settings would, coordinator/claims.py, the elected leader's report counting as
    its own trusted compute probes; ``evidence``: :func:`verification_status`)."""
    leader = elect_leader(candidates)
    cfg = CoordinatorConfig(num_layers=plan.plan.num_layers if plan else 1)
    # the elected leader's own report holds its compute probes, which it trusts (compute_probe.py)
    judged = claims.verdicts(peers, list(reports), cfg, frozenset({leader.coordinator_id}) if leader else frozenset())
    out: dict[str, Any] = {
        "peers": [_peer_row(p, plan, now, judged[p.peer_id])
                  for p in sorted(peers.values(), key=lambda p: (p.serving or (1 << 30, 0), p.peer_id))],
        "links": [
            {"src": li.peer_id, "dst": other, "bandwidth_Bps": s.bandwidth, "rtt_s": s.rtt}
            for li in sorted(links, key=lambda li: li.peer_id)
            for other, s in sorted(li.links.items())
        ],
        "coordinators": [
            {"id": c.coordinator_id, "priority": c.priority, "start_time": c.start_time,
             "leader": leader is not None and c.coordinator_id == leader.coordinator_id}
            for c in sorted(candidates, key=lambda c: c.coordinator_id)
        ],
        "leader": leader.coordinator_id if leader else None,
        "plan": _plan_status(plan, now) if plan is not None else None,
    }
    out.update(verification_status(evidence or [], peers, plan, trusted_verifiers))
    return out


def verification_status(evidence: list, peers: dict[str, PeerInfo], plan: Optional[SignedPlan],
                        trusted_verifiers: tuple[str, ...]) -> dict[str, Any]:
    """Every accusation in the evidence records (whether it holds, and why not), and the peers
    excluded with the reason (``coordinator/exclusion.py``): a trusted verifier's holding case, or
    an accused peer the plan gives no layers (the leader convicts only on its own re-execution,
    ``coordinator/retrial.py``, which a reader cannot redo); ``in_plan`` says whether the plan
    followed still gives the peer layers."""
    from p2pserve.coordinator.exclusion import case_holds, judge
    from p2pserve.coordinator.service import key_text, verifier_set

    trusted = verifier_set(trusted_verifiers)
    findings = judge(evidence, peers, lambda signer, reporter: key_text(signer) in trusted or reporter in trusted)
    spans = plan.plan.spans if plan is not None else {}
    found = dict(findings.convicted)
    for pid, cases in findings.accused.items():
        if plan is not None and pid not in spans:
            found[pid] = f"accused ({len(cases)} case(s)), not in the leader's plan: convicted on its re-execution"
    accusations = [
        {"accused": c.accused.claim.peer_id, "reporter": s.record.reporter_id, "kind": c.kind,
         "layers": [c.accused.claim.start, c.accused.claim.end], "position": c.accused.claim.position,
         "witnesses": [w.claim.peer_id for w in c.witnesses], "holds": case_holds(c, peers) or "yes"}
        for s in evidence for c in s.record.cases
    ]
    return {"accusations": accusations,
            "excluded": [{"peer_id": p, "reason": r, "in_plan": p in spans} for p, r in sorted(found.items())]}
