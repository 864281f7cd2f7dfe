"""``p2pserve status``: the swarm as the DHT shows it.

    p2pserve status --initial-peers /ip4/.../p2p/Qm... --model M [--json]

Peers (state, served and loading range, device, decode throughput at the served size, KV
load, claimed vs effective rate and why it is capped), measured links, coordinators and the
elected leader, the followed plan (epoch, targets, max-flow, upper bound) and its flows. The formatting is pure (:func:`collect_status`,
:func:`format_status`) so it is tested without a network.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any, Optional, Sequence

from p2pserve.cli.common import add_dht_arguments, dht_config_from_args, setup_logging
from p2pserve.clock import wall
from p2pserve.config import CoordinatorConfig
from p2pserve.coordinator import claims
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.reports import ServiceReports
from p2pserve.dht.election import SignedPlan, elect_leader
from p2pserve.dht.evidence import Evidence
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.records import CoordinatorCandidate, LinkInfo, PeerInfo


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``p2pserve status``."""
    add_dht_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--trusted-verifier", dest="trusted_verifiers", action="append", default=[],
                        metavar="KEY|PEER_ID", help="judge evidence as a coordinator trusting this verifier does")
    parser.add_argument("--evidence-min-reporters", type=int, default=3,
                        help="distinct clients whose evidence excludes a peer, as the coordinator counts them")


def _span(s) -> Optional[list[int]]:
    return None if s is None else [int(s[0]), int(s[1])]


def _peer_row(p: PeerInfo, plan: Optional[SignedPlan], now: float, verdict: claims.Verdict) -> dict[str, Any]:
    """One peer's entry of :func:`collect_status`."""
    return {
        "peer_id": p.peer_id,
        # "loading (handover)": loaded, waiting for its dropped layers to be covered
        "state": f"{p.state} (handover)" if p.state == "loading" and p.loaded else p.state,
        "serving": _span(p.serving),
        "loading": _span(p.loading),
        "target": _span(plan.plan.targets.get(p.peer_id)) if plan else None,
        "device": p.device,
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


def collect_status(
    peers: dict[str, PeerInfo],
    links: list[LinkInfo],
    candidates: list[CoordinatorCandidate],
    plan: Optional[SignedPlan],
    now: float,
    reports: Sequence[ServiceReports] = (),
    evidence: Optional[list] = None, trusted_verifiers: tuple[str, ...] = (), min_reporters: int = 3,
) -> dict[str, Any]:
    """A JSON-ready description of the swarm (``reports``: clients' observed service rates, from
    which each peer's claimed and effective one-layer rate are judged as a coordinator with the
    default claims settings would, coordinator/claims.py; ``evidence``: :func:`verification_status`)."""
    leader = elect_leader(candidates)
    cfg = CoordinatorConfig(num_layers=plan.plan.num_layers if plan else 1)
    judged = claims.verdicts(peers, list(reports), cfg)
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
        "plan": None,
    }
    out.update(verification_status(evidence or [], peers, plan, trusted_verifiers, min_reporters))
    if plan is not None:
        p = plan.plan
        cover = p.coverage()
        out["plan"] = {
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
    return out


def verification_status(evidence: list, peers: dict[str, PeerInfo], plan: Optional[SignedPlan],
                        trusted_verifiers: tuple[str, ...], min_reporters: int) -> dict[str, Any]:
    """Every accusation in the evidence records (whether it holds, and why not), and the peers it
    excludes with the reason (``coordinator/exclusion.py``); ``in_plan`` says whether the plan
    followed still gives the peer layers."""
    from p2pserve.coordinator.exclusion import case_holds, judge
    from p2pserve.coordinator.service import verifier_set, key_text

    trusted = verifier_set(trusted_verifiers)
    found = judge(evidence, peers, lambda signer, reporter: key_text(signer) in trusted or reporter in trusted,
                  min_reporters)
    spans = plan.plan.spans if plan is not None else {}
    accusations = [
        {"accused": c.accused.claim.peer_id, "reporter": s.record.reporter_id, "kind": c.kind,
         "layers": [c.accused.claim.start, c.accused.claim.end], "position": c.accused.claim.position,
         "witnesses": [w.claim.peer_id for w in c.witnesses], "holds": case_holds(c, peers) or "yes"}
        for s in evidence for c in s.record.cases
    ]
    return {"accusations": accusations,
            "excluded": [{"peer_id": p, "reason": r, "in_plan": p in spans} for p, r in sorted(found.items())]}


def _short(pid: Optional[str]) -> str:
    if pid is None:
        return "-"
    return pid if len(pid) <= 12 or pid in ("source", "sink") else "…" + pid[-10:]


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [["-" if v is None else str(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def format_status(d: dict[str, Any]) -> str:
    """Human-readable tables of :func:`collect_status` output."""
    rng = lambda s: "-" if s is None else f"[{s[0]},{s[1]})"  # noqa: E731
    parts = [f"PEERS ({len(d['peers'])})"]
    parts.append(_table(
        ["peer", "state", "serving", "loading", "target", "device", "decode tok/s", "kv free", "queued", "age s"],
        [[_short(p["peer_id"]), p["state"], rng(p["serving"]), rng(p["loading"]), rng(p["target"]), p["device"],
          None if p["decode_tps"] is None else f"{p['decode_tps']:.1f}", p["kv_free_tokens"], p["queued_tokens"], p["age_s"]]
         for p in d["peers"]],
    ))
    capped = [p for p in d["peers"] if p.get("effective_tps", 0) < p.get("claimed_tps", 0) * (1 - 1e-9)]
    parts.append(f"\nCLAIMS (one-layer decode tok/s; {len(capped)} capped)")
    parts.append(_table(["peer", "claimed", "effective", "why"],
                        [[_short(p["peer_id"]), f"{p['claimed_tps']:.1f}", f"{p['effective_tps']:.1f}", p["claim"]]
                         for p in d["peers"] if "claim" in p]))
    parts.append(f"\nLINKS ({len(d['links'])})")
    parts.append(_table(["from", "to", "MB/s", "rtt ms"],
                        [[_short(l["src"]), _short(l["dst"]), f"{l['bandwidth_Bps'] / 1e6:.2f}", f"{l['rtt_s'] * 1e3:.2f}"] for l in d["links"]]))
    parts.append(f"\nCOORDINATORS (leader: {_short(d['leader'])})")
    parts.append(_table(["id", "priority", "leader"], [[_short(c["id"]), c["priority"], "*" if c["leader"] else ""] for c in d["coordinators"]]))
    p = d["plan"]
    if p is None:
        parts.append("\nPLAN: none published")
    else:
        parts.append(
            f"\nPLAN epoch {p['epoch']} by {_short(p['leader_id'])} ({p['reason']}, {p['age_s']} s ago): "
            f"max-flow {p['max_flow']:.1f} tok/s, upper bound {p['upper_bound']:.1f}, solve {p['solve_time_s'] * 1e3:.1f} ms"
            + (f", UNCOVERED layers {p['uncovered_layers']}" if p["uncovered_layers"] else "")
            + (f", {len(p['defaulted_links'])} links defaulted" if p["defaulted_links"] else "")
        )
        parts.append(_table(["from", "to", "tok/s"], [[_short(f["src"]), _short(f["dst"]), f"{f['tokens_per_s']:.1f}"] for f in p["flows"]]))
    if d.get("excluded") or d.get("accusations"):
        parts.append(f"\nEXCLUDED ({len(d['excluded'])}): peers verified evidence takes out of the plan")
        parts.append(_table(["peer", "in plan", "reason"],
                            [[e["peer_id"], "yes" if e["in_plan"] else "no", e["reason"]] for e in d["excluded"]]))
        parts.append(f"\nACCUSATIONS ({len(d['accusations'])})")
        parts.append(_table(["accused", "reporter", "kind", "layers", "position", "holds"],
                            [[_short(a["accused"]), _short(a["reporter"]), a["kind"], rng(a["layers"]), a["position"],
                              a["holds"]] for a in d["accusations"]]))
    return "\n".join(parts)


def run(args: argparse.Namespace) -> int:
    """Read the swarm once and print it."""
    setup_logging("WARNING" if args.log_level == "INFO" else args.log_level)
    from p2pserve.dht.swarm import Swarm

    dcfg, _ = dht_config_from_args(args)
    dcfg = dcfg.replace(client_mode=True, host_maddrs=("/ip4/127.0.0.1/tcp/0",) if not args.host_maddrs else dcfg.host_maddrs)
    swarm = Swarm.create(dcfg)
    try:
        async def read():
            peers = {pid: s.record for pid, s in (await swarm.get_peers()).items()}
            links = [s.record for s in (await swarm.get_links()).values()]
            cands = [s.record for s in await swarm.get_candidates()]
            reports = [s.record for s in await swarm.read(RecordKind.REPORTS, ServiceReports)]
            evidence = await swarm.read(RecordKind.EVIDENCE, Evidence)
            return peers, links, cands, await swarm.get_plan(), reports, evidence

        async def read_settled():
            # a node that just joined may not reach every replica on its first read
            for attempt in range(3):
                got = await read()
                if got[0] and got[3] is not None:
                    break
                await asyncio.sleep(0.5 * (attempt + 1))
            return got

        peers, links, cands, plan, reports, evidence = asyncio.run(read_settled())
        d = collect_status(peers, links, cands, plan, wall(), reports, evidence, tuple(args.trusted_verifiers),
                           args.evidence_min_reporters)
    finally:
        swarm.shutdown()
    if args.json:
        json.dump(d, sys.stdout, indent=2)
        print()
    else:
        print(format_status(d))
    return 0
