"""Claims checked against what is observed, and per-address caps (pure policy, no I/O).

A peer announces its own throughput table; nothing stops it from lying. Before planning, the
coordinator runs :func:`police` on its snapshot:

1. **Per-address cap** (``max_peers_per_address``, 0 = off): peers are grouped by the IPs of
   their announced addresses (loopback and link-local ones only count for a peer that announces
   nothing else; relayed ``p2p-circuit`` addresses name the relay, not the peer, and do not
   count). Peers are admitted in order (serving first, then the lowest claimed one-layer rate,
   then peer id) while each of their IPs holds fewer than the cap; the rest are left out of the
   plan with a reason. Inflating a claim therefore puts a peer last in its address's queue.
2. **Claim caps** (``check_claims``): a peer's tables are scaled by ``factor`` so that its
   effective rate is ``min(claim, claim_slack x observed)``. ``observed`` comes from the
   :class:`~p2pserve.dht.reports.ServiceReports` clients publish: per report, the per-session
   rate (RTT-corrected, at most ``max_rtt_credit`` times the wall-clock rate) times
   ``claim_batch``, divided by the claim at the layer count the client used; one such ratio per
   reporter address (the reporter with most samples), only reports of at least
   ``min_report_samples`` samples, never a peer's report on itself; the median over addresses,
   counted only when at least ``min_reporter_addresses`` addresses observed the peer.
   **Trusted observations** (``trusted`` reporter ids: the coordinator's own compute probes,
   ``coordinator/compute_probe.py``) count on their own, without ``min_reporter_addresses``:
   ``observed`` is then the smaller of the probe's ratio and the clients' median.
   A peer nobody observed is capped at ``unobserved_share`` x the median effective one-layer
   rate of the observed peers, so it still gets flow, gets used and observed; all unobserved
   peers together get at most ``unobserved_total_share`` x the observed peers' total (a Sybil
   flood of fresh identities shares that budget). While nobody is observed (a cold swarm), a
   claim is capped at ``cold_claim_slack`` x the median claim, which a minority cannot move.

What it cannot stop (docs/trust.md, "Claims"): reports are as honest as their reporters, and a
reporter's address and identity are self-announced, so a Sybil set of clients can vouch for a
Sybil set of peers; addresses are self-announced too, so the per-address cap binds only an
attacker who must be reachable at the addresses it announces.
"""

from __future__ import annotations

import ipaddress
import statistics
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Optional, Sequence

import msgspec

from p2pserve.config import CoordinatorConfig
from p2pserve.coordinator.snapshot import Snapshot
from p2pserve.dht.records import MAX_LAYER_MS, LatencyPoints, PeerInfo
from p2pserve.dht.receipts import verify_receipt
from p2pserve.dht.reports import ServiceReports
from p2pserve.transport.tcp import maddr_hosts
from p2pserve.types import PeerId


@dataclass(frozen=True)
class Verdict:
    """Why a peer plans at the rate it does: ``claimed`` and ``effective`` are its one-layer
    decode rates (tokens/s); ``reason`` is ``"observed"``, ``"probed"`` (by the coordinator only), ``"unobserved"``, ``"cold"`` (no
    report in the swarm yet), ``"address cap"`` or ``"no cap"``; ``observed`` the median ratio of observed to claimed (None if unobserved)."""

    peer_id: PeerId
    claimed: float
    effective: float
    reason: str
    reporters: int = 0
    observed: Optional[float] = None
    probed: Optional[float] = None  # the coordinator's own probe's ratio of observed to claimed
    # per layer count j (index j - 1), the most the peer's decode table may say (empty: no cap
    # beyond ``effective``): a newcomer's or a cold swarm's cap binds every entry, so a flat
    # table (the one-layer rate claimed for every layer count) gains nothing at many layers
    ceiling: tuple[float, ...] = ()

    @property
    def capped(self) -> bool:
        """Whether the peer plans below its claim (or not at all)."""
        return self.reason == "address cap" or self.effective < self.claimed * (1 - 1e-9)

    def describe(self) -> str:
        """One line for logs and ``p2pserve status``."""
        if self.reason == "address cap":
            return "left out: too many peers at its address"
        if self.reason == "cold" and self.capped:
            return f"capped to {self.effective / max(self.claimed, 1e-12):.3g} of its claim (no reports yet: " \
                   "at most cold_claim_slack x the median claim)"
        if not self.capped:
            return f"{self.reason}, claim stands"
        if self.observed is None:
            how = "nobody observed it yet: capped at the swarm's median"
        elif self.reason == "probed":
            how = f"the coordinator's compute probe saw {self.probed:.3g} of the claim"
        else:
            how = f"{self.reporters} reporters saw {self.observed:.3g} of the claim" + (
                f", the coordinator's compute probe {self.probed:.3g}" if self.probed is not None else "")
        return f"capped to {self.effective / max(self.claimed, 1e-12):.3g} of its claim ({how})"


def address_keys(addrs: Iterable[str]) -> frozenset[str]:
    """The IPs a peer's multiaddrs name (loopback/link-local ones only if nothing else is left)."""
    ips: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    for host in maddr_hosts(addrs):  # relayed addresses skipped: their IP is the relay's
        try:
            ips.append(ipaddress.ip_address(host))
        except ValueError:
            pass
    public = [ip for ip in ips if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified)]
    return frozenset(str(ip) for ip in (public or ips))


def one_layer(p: PeerInfo) -> float:
    """The peer's claimed decode rate holding one layer (0 if it has not profiled)."""
    return p.decode_rate(1)


def cap_per_address(peers: Mapping[str, PeerInfo], limit: int) -> tuple[dict[str, PeerInfo], dict[str, str]]:
    """At most ``limit`` peers per IP (0: everyone); returns (kept peers, {left-out id: reason})."""
    if limit <= 0:
        return dict(peers), {}
    order = sorted(peers.values(), key=lambda p: (p.serving is None, one_layer(p), p.peer_id))
    count: dict[str, int] = {}
    kept, dropped = {}, {}
    for p in order:
        ips = address_keys(p.addrs)
        full = sorted(ip for ip in ips if count.get(ip, 0) >= limit)
        if full:
            dropped[p.peer_id] = f"{limit} peers already announce {full[0]} (max_peers_per_address)"
            continue
        for ip in ips:
            count[ip] = count.get(ip, 0) + 1
        kept[p.peer_id] = p
    return kept, dropped


def observed_ratios(peers: Mapping[str, PeerInfo], reports: Sequence[ServiceReports],
                    cfg: CoordinatorConfig) -> dict[str, list[float]]:
    """Per peer, one observed/claimed ratio per reporter address (see the module docstring)."""
    best: dict[tuple[str, frozenset[str] | str], tuple[int, float]] = {}
    for rep in reports:
        where = address_keys(rep.addrs) or rep.reporter_id  # no address: one vote per reporter id
        for r in rep.rates:
            p = peers.get(r.peer_id)
            if p is None or r.samples < cfg.min_report_samples or rep.reporter_id == r.peer_id:
                continue
            claim = p.decode_rate(r.layers)
            if claim <= 0:
                continue  # a layer count the peer claims nothing for: not comparable
            rate = min(r.rate, r.wall_rate * cfg.max_rtt_credit) * cfg.claim_batch
            key = (r.peer_id, where)
            if key not in best or r.samples > best[key][0]:
                best[key] = (r.samples, rate / claim)
    out: dict[str, list[float]] = {}
    for (pid, _), (_, ratio) in best.items():
        out.setdefault(pid, []).append(ratio)
    return out


def verdicts(peers: Mapping[str, PeerInfo], reports: Sequence[ServiceReports], cfg: CoordinatorConfig,
             trusted: frozenset[str] = frozenset()) -> dict[str, Verdict]:
    """Each peer's claimed and effective one-layer rate, and why (``trusted``: reporter ids whose
    reports count on their own, the coordinator's compute probes)."""
    # a peer counts as observed only by min_reporter_addresses independent addresses: one address
    # (however many client identities it runs) can neither vouch for a peer nor defame one
    # a client's entry on a peer counts only with that peer's receipt for the client: a key that
    # was never served by the peer (a throwaway reporter) cannot report on it
    clients = [receipted(r, peers) for r in reports if r.reporter_id not in trusted]
    ratios = {pid: rs for pid, rs in observed_ratios(peers, clients, cfg).items() if len(rs) >= cfg.min_reporter_addresses}
    probed = {pid: min(rs) for pid, rs in observed_ratios(
        peers, [r for r in reports if r.reporter_id in trusted], cfg).items()}
    out: dict[str, Verdict] = {}
    for pid in sorted(set(ratios) | set(probed)):
        claim = one_layer(peers[pid])
        # the coordinator's own probe wins: reports (free identities, self-announced addresses) may
        # neither raise nor lower what it measured itself; without a probe the clients' median counts
        seen = probed[pid] if pid in probed else statistics.median(ratios[pid])
        out[pid] = Verdict(pid, claim, claim * min(1.0, cfg.claim_slack * seen),
                           "probed" if pid in probed else "observed", len(ratios.get(pid, ())), seen, probed.get(pid))
    unobserved = [pid for pid in peers if pid not in out]
    if not out:  # a cold swarm: no report yet; a minority cannot move the median of the claims
        ceiling = [cfg.cold_claim_slack * m for m in median_table([p.throughput_decode for p in peers.values()])]
        return {pid: Verdict(pid, one_layer(p), min([one_layer(p), *ceiling[:1]]), "cold", ceiling=tuple(ceiling))
                for pid, p in peers.items()}
    observed_total = sum(v.effective for v in out.values())
    effective_tables = [[t * v.effective / v.claimed for t in peers[pid].throughput_decode] if v.claimed > 0 else []
                        for pid, v in out.items()]
    ref = [cfg.unobserved_share * m for m in median_table(effective_tables)]
    fresh = {pid: min([one_layer(peers[pid]), *ref[:1]]) for pid in unobserved}
    # newcomers together get at most unobserved_total_share of what the observed peers deliver:
    # a hundred fresh identities share one newcomers' budget instead of a median each
    budget = cfg.unobserved_total_share * observed_total
    squeeze = min(1.0, budget / sum(fresh.values())) if sum(fresh.values()) > 0 else 1.0
    for pid, rate in fresh.items():
        out[pid] = Verdict(pid, one_layer(peers[pid]), rate * squeeze, "unobserved",
                           ceiling=tuple(r * squeeze for r in ref))
    return out


def receipted(report: ServiceReports, peers: Mapping[str, PeerInfo]) -> ServiceReports:
    """``report`` keeping only its entries that carry the reported peer's valid receipt for the
    reporter (``dht/receipts.py``), under the reply key the peer announces now."""
    rates = [r for r in report.rates if r.peer_id in peers
             and verify_receipt(peers[r.peer_id].reply_key, r.peer_id, report.reporter_id, r.receipt)]
    return report if len(rates) == len(report.rates) else msgspec.structs.replace(report, rates=rates)


def median_table(tables: Sequence[Sequence[float]]) -> list[float]:
    """Per layer count, the median entry over the ``tables`` that have one (as long as the longest)."""
    longest = max((len(t) for t in tables), default=0)
    out: list[float] = []
    for j in range(longest):
        column = [t[j] for t in tables if len(t) > j]
        out.append(statistics.median(column))
    return out


def capped(p: PeerInfo, v: Verdict) -> PeerInfo:
    """``p`` planned as its verdict says: its tables scaled to ``v.effective`` and each decode
    entry at most ``v.ceiling``'s (the prefill table scaled alike, entry by entry)."""
    factor = v.effective / v.claimed if v.claimed > 0 else 1.0
    out = scaled(p, factor)
    if not v.ceiling or not out.throughput_decode:
        return out
    decode = list(out.throughput_decode)
    last = v.ceiling[-1] * len(v.ceiling)  # beyond the reference's layer counts: one layer's share
    limits = [v.ceiling[j] if j < len(v.ceiling) else last / (j + 1) for j in range(len(decode))]
    shrink = [min(1.0, lim / t) if t > 0 else 1.0 for t, lim in zip(decode, limits)]
    if all(s >= 1.0 for s in shrink):
        return out
    prefill = [t * shrink[j] if j < len(shrink) else t for j, t in enumerate(out.throughput_prefill)]
    return msgspec.structs.replace(out, throughput_decode=[t * s for t, s in zip(decode, shrink)],
                                   throughput_prefill=prefill)


def scaled(p: PeerInfo, factor: float) -> PeerInfo:
    """``p`` with both throughput tables multiplied by ``factor`` (<= 1) and its announced
    latencies divided by it: a peer observed at half its claim is simulated at half speed too."""
    if factor >= 1.0:
        return p
    latency = p.latency
    if latency is not None:
        slow = 1.0 / max(factor, 1e-3)
        latency = LatencyPoints(prompt=[(n, min(ms * slow, MAX_LAYER_MS)) for n, ms in latency.prompt],
                                decode=[(n, min(ms * slow, MAX_LAYER_MS)) for n, ms in latency.decode])
    return msgspec.structs.replace(p, throughput_decode=[t * factor for t in p.throughput_decode],
                                   throughput_prefill=[t * factor for t in p.throughput_prefill], latency=latency)


def police(snap: Snapshot, reports: Sequence[ServiceReports], cfg: CoordinatorConfig,
           trusted: frozenset[str] = frozenset()) -> tuple[Snapshot, dict[str, Verdict]]:
    """The snapshot the planner should see: address caps applied, claims scaled to what is
    observed (``trusted``: see :func:`verdicts`); and every peer's :class:`Verdict`."""
    kept, dropped = cap_per_address(snap.peers, cfg.max_peers_per_address)
    out: dict[str, Verdict] = {pid: Verdict(pid, one_layer(snap.peers[pid]), 0.0, "address cap") for pid in dropped}
    if cfg.check_claims:
        found = verdicts(kept, reports, cfg, trusted)
        kept = {pid: capped(p, found[pid]) for pid, p in kept.items()}
    else:
        found = {pid: Verdict(pid, one_layer(p), one_layer(p), "no cap") for pid, p in kept.items()}
    out.update(found)
    links = {k: v for k, v in snap.links.items() if k[0] in kept and k[1] in kept}
    return replace(snap, peers=kept, links=links), out
