"""Sybil benchmark: the share of a plan's flow that peers with inflated claims capture, before
and after the claims policy (``p2pserve/coordinator/claims.py``, docs/trust.md "Claims").

The honest swarm is Helix's cluster24 (24 GPUs: A100, L4, T4) serving llama2-70b (80 layers),
each peer at its own IP and claiming its true decode table. Attackers are 1, 10 or 100 peers
whose real hardware is an L4 but who announce ``throughput_decode = 1e8 / j`` (the record's
maximum) and room for 12 layers, from one IP or from one IP each. The coordinator's real path
runs: snapshot -> ``claims.police`` -> ``make_plan`` (the MILP planner's targets) -> every peer
serves its target -> ``compute_flows`` (max-flow). The figure is the share of the flow into
plan's layer-work that attackers get (``share``: tokens/s through a peer times the layers it
runs, summed over attackers, over all peers; with every layer of the model on one peer this is
its share of the flow). Per row, ``route_share`` is the share of client tokens whose route
passes through at least one attacker (one minus the most of the plan's flow routable around
them all): in a pipeline it is 1 as soon as an attacker is the only holder of some layer,
whatever its claim, so it measures coverage, not capture.

* **before**: the policy off (``check_claims=False``, no per-address cap): today's coordinator;
* **after**: ``check_claims`` with the defaults and ``max_peers_per_address=2``; three honest
  clients at distinct IPs report every honest peer at its claimed rate (x 0.7-1.3, seeded);
  two attacker variants, the worst of which is the "after" figure: ``unobserved`` (nobody used
  the attackers yet), ``vouched`` (20 Sybil clients from one IP report the attackers at 1e6
  tokens/s per session; honest clients have not used them). A third row, ``observed`` (honest
  clients used the attackers and report the real rate of an L4 each), is not capture: each
  identity then delivers a real L4's service, so it is real capacity and is planned as such
  (``observed_real_hardware`` in the JSON; it credits every identity with its own L4, which
  overstates identities that share one GPU).

Links are not the question here: every link is assumed fast (1 GB/s), so claims bind.

    python benchmarks/sybil.py [--time-limit 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402
import networkx as nx  # noqa: E402

from p2pserve.config import CoordinatorConfig  # noqa: E402
from p2pserve.coordinator import claims  # noqa: E402
from p2pserve.coordinator.plan_record import compute_flows, make_plan  # noqa: E402
from p2pserve.coordinator.snapshot import Snapshot  # noqa: E402
from p2pserve.coordinator.trigger import Reason, Trigger  # noqa: E402
from p2pserve.dht.records import MAX_TOKENS_PER_S, PeerInfo  # noqa: E402
from p2pserve.dht.reports import ObservedRate, ServiceReports  # noqa: E402
from p2pserve.helix.root import data_root  # noqa: E402
from p2pserve.helix.topology import load_helix_topology  # noqa: E402

CLUSTER, MODEL = "clusters/single_cluster/cluster24.ini", "llama2-70b"
COUNTS = (1, 10, 100)
SYBIL_LAYERS = 12


def honest_peers() -> tuple[list[PeerInfo], dict[str, list[float]], int, int]:
    """cluster24's nodes as PeerInfo records (each at its own IP); (peers, true tables, layers, act bytes)."""
    topo = load_helix_topology(data_root() / CLUSTER, MODEL)
    peers, truth = [], {}
    for i, n in enumerate(topo.nodes):
        pid = f"honest-{i:02d}-{n.gpu_type}"
        table = [float(x) for x in n.throughput[1:]]
        truth[pid] = table
        peers.append(PeerInfo(model=MODEL, peer_id=pid, addrs=[f"/ip4/10.0.{i}.1/tcp/31338/p2p/{pid}"],
                              device=n.gpu_type, weights_memory_bytes=int(n.memory_bytes), throughput_decode=table,
                              max_layers=len(table), state="joining"))
    l4 = next(t for pid, t in truth.items() if pid.endswith("L4"))
    truth["L4"] = l4
    return peers, truth, topo.num_layers, topo.activation_bytes


def sybils(n: int, one_address: bool) -> list[PeerInfo]:
    """``n`` attackers claiming 1e8 tokens/s at one layer and 12 layers of room."""
    out = []
    for i in range(n):
        ip = "203.0.113.9" if one_address else f"198.51.{i // 250}.{i % 250 + 1}"
        pid = f"sybil-{i:03d}"
        out.append(PeerInfo(model=MODEL, peer_id=pid, addrs=[f"/ip4/{ip}/tcp/{4000 + i}/p2p/{pid}"], device="L4",
                            weights_memory_bytes=40 * 10**9, max_layers=SYBIL_LAYERS, state="joining",
                            throughput_decode=[MAX_TOKENS_PER_S / j for j in range(1, SYBIL_LAYERS + 1)]))
    return out


def observation(pid: str, table: list[float], cfg: CoordinatorConfig, noise: float, layers: int) -> ObservedRate:
    """What a client sees of a peer whose real decode table is ``table`` (per session, at full batch)."""
    layers = min(layers, len(table))
    per_session = table[layers - 1] / cfg.claim_batch * noise
    return ObservedRate(peer_id=pid, layers=layers, samples=64, rate=per_session, wall_rate=per_session * 0.9,
                        observed_at=1.0)


def reports(honest: list[PeerInfo], attackers: list[PeerInfo], truth: dict, cfg: CoordinatorConfig,
            variant: str, seed: int) -> list[ServiceReports]:
    """Three honest clients' reports (and, for ``vouched``, 20 Sybil clients' from one IP)."""
    rng = random.Random(seed)
    out = []
    for c in range(3):
        rates = [observation(p.peer_id, truth[p.peer_id], cfg, rng.uniform(0.7, 1.3), p.max_layers) for p in honest]
        if variant == "observed":
            rates += [observation(a.peer_id, truth["L4"], cfg, rng.uniform(0.7, 1.3), SYBIL_LAYERS) for a in attackers]
        out.append(ServiceReports(model=MODEL, reporter_id=f"client-{c}", addrs=[f"/ip4/192.0.2.{c + 1}/tcp/1"],
                                  rates=rates, timestamp=1.0))
    if variant == "vouched":
        for c in range(20):
            rates = [ObservedRate(peer_id=a.peer_id, layers=1, samples=64, rate=1e6, wall_rate=1e6) for a in attackers]
            out.append(ServiceReports(model=MODEL, reporter_id=f"sybil-client-{c}", addrs=["/ip4/203.0.113.77/tcp/1"],
                                      rates=rates, timestamp=1.0))
    return out


def route_share(flows, value: float, attackers: set[str]) -> float:
    """The share of the plan's tokens/s whose route passes through at least one attacker: one
    minus the most of the flow that can be routed over the plan's edges avoiding them all."""
    if value <= 0:
        return 0.0
    g = nx.DiGraph()
    for f in flows:
        if f.src not in attackers and f.dst not in attackers and f.rate > 0:
            g.add_edge(f.src, f.dst, capacity=f.rate)
    clean = nx.maximum_flow_value(g, "source", "sink") if g.has_node("source") and g.has_node("sink") else 0.0
    return max(0.0, 1.0 - clean / value)


def flow_share(peers: list[PeerInfo], reps: list[ServiceReports], cfg: CoordinatorConfig, attackers: set[str]) -> dict:
    """Plan targets, let every peer serve its target, compute flows; the attackers' share of inflow."""
    snap, found = claims.police(Snapshot({p.peer_id: p for p in peers}), reps, cfg)
    plan = make_plan(snap, {}, epoch=1, leader_id="bench", model=MODEL, cfg=cfg, reason=Reason(Trigger.INITIAL), now=1.0)
    served = {pid: msgspec.structs.replace(p, serving=plan.targets[pid], state="serving")
              for pid, p in snap.peers.items() if pid in plan.targets}
    flows, value, _, _, _ = compute_flows(replace(snap, peers=served), cfg)
    inflow: dict[str, float] = {}
    for f in flows:
        if f.dst not in ("source", "sink"):
            inflow[f.dst] = inflow.get(f.dst, 0.0) + f.rate
    # layer-work: tokens/s through a peer times the layers it runs for them
    work = {pid: r * (served[pid].serving[1] - served[pid].serving[0]) for pid, r in inflow.items()}
    total = sum(work.values())
    return {"share": sum(w for pid, w in work.items() if pid in attackers) / total if total else 0.0,
            "route_share": route_share(flows, value, attackers),
            "max_flow": value, "attackers_with_flow": sum(1 for pid in attackers if inflow.get(pid, 0) > 0),
            "attackers_left_out": sum(1 for pid in attackers if found[pid].reason == "address cap")}


def measure(time_limit: float = 2.0, counts=COUNTS, seed: int = 0, log=print) -> dict:
    """Every scenario; returns the JSON-ready result (``benchmarks/trust.py`` imports this)."""
    honest, truth, num_layers, act = honest_peers()
    base = dict(num_layers=num_layers, activation_bytes=act, solve_time_limit=time_limit, seed=seed,
                default_bandwidth=1e9, client_bandwidth=1e9)
    before = CoordinatorConfig(**base, check_claims=False)
    after = CoordinatorConfig(**base, max_peers_per_address=2)
    honest_only = flow_share(honest, [], before, set())
    rows, summary = [], {}
    for n in counts:
        for one_address in ((False,) if n == 1 else (False, True)):
            attackers = sybils(n, one_address)
            names = {a.peer_id for a in attackers}
            peers = honest + attackers
            row = {"sybils": n, "origin": "one address" if one_address else "one address each"}
            t0 = time.perf_counter()
            row["before"] = flow_share(peers, [], before, names)
            for variant in ("unobserved", "observed", "vouched"):
                row[variant] = flow_share(peers, reports(honest, attackers, truth, after, variant, seed), after, names)
            row["after"] = max(row[v]["share"] for v in ("unobserved", "vouched"))
            row["seconds"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            log(f"{n:>4} sybils, {row['origin']:<16} before {row['before']['share']:.4f}  after {row['after']:.4f}  "
                f"(unobserved {row['unobserved']['share']:.4f}, observed {row['observed']['share']:.4f}, "
                f"vouched {row['vouched']['share']:.4f}; ratio after/before "
                f"{row['after'] / max(row['before']['share'], 1e-12):.3f})")
            cur = summary.setdefault(str(n), {"before": 0.0, "after": 0.0, "observed_real_hardware": 0.0})
            cur["before"] = max(cur["before"], row["before"]["share"])
            cur["after"] = max(cur["after"], row["after"])
            cur["observed_real_hardware"] = max(cur["observed_real_hardware"], row["observed"]["share"])
    return {"cluster": CLUSTER, "model": MODEL, "honest_peers": len(honest),
            "honest_max_flow": honest_only["max_flow"], "sybil_flow_share": summary, "rows": rows,
            "settings": {"claim_slack": after.claim_slack, "claim_batch": after.claim_batch,
                         "unobserved_total_share": after.unobserved_total_share,
                         "max_peers_per_address": after.max_peers_per_address, "time_limit_s": time_limit}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=2.0, help="seconds per placement solve")
    ap.add_argument("--counts", type=int, nargs="+", default=list(COUNTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    out = measure(args.time_limit, tuple(args.counts), args.seed)
    print(json.dumps(out["sybil_flow_share"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
