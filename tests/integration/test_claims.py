"""Claims with real processes: an inflated claim and a Sybil flood are capped.

A bootstrap node, a real coordinator (claims checked, at most one peer per IP) and synthetic
peers (real DHT nodes announcing real signed PeerInfo records, following the plan), each honest
one at its own loopback IP: two honest peers at 400 tokens/s, one liar at 5e6 tokens/s (a
valid record, 12,500x the honest claim) and two Sybils at 5e6 from one IP. Two client nodes
publish real signed ServiceReports records: each used the honest peers and the liar (and holds
their signed service receipts), and saw all three at the honest rate. The plan must give the liar no more than its observed share,
let one Sybil at most receive flow, and ``p2pserve status`` must say why the liar is capped.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from p2pserve.cli.status import collect_status
from p2pserve.config import DHTConfig
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.reports import ObservedRate, ServiceReports
from p2pserve.dht.swarm import Swarm
from tests.integration.processes import Procs
from tests.support import wait_for

pytestmark = pytest.mark.integration

MODEL, NUM_LAYERS = "tiny-claims", 8
TIMING = dict(peer_refresh=0.5, candidate_refresh=0.5, plan_refresh=3.0, link_refresh=2.0, max_clock_skew=2.0)
PEERS = {"honest-1": ("127.0.0.2", 400.0), "honest-2": ("127.0.0.3", 400.0), "liar": ("127.0.0.5", 5e6),
         "sybil-1": ("127.0.0.9", 5e6), "sybil-2": ("127.0.0.9", 5e6)}


def test_an_inflated_claim_and_a_sybil_flood_are_capped(tmp_path):
    procs = Procs(tmp_path)
    client = witness = None
    loop = asyncio.new_event_loop()
    try:
        maddrs_file = tmp_path / "boot.maddrs"
        receipts = tmp_path / "receipts"  # the peers sign a service receipt for each client named here
        receipts.mkdir()
        procs.start("bootstrap", ["-m", "p2pserve.cli", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                  "--maddrs-file", str(maddrs_file)])
        wait_for(maddrs_file.exists, "bootstrap multiaddrs")
        boot = maddrs_file.read_text().split()
        cfg_path = tmp_path / "swarm.json"
        cfg_path.write_text(json.dumps({
            "swarm_id": "claims-test", "model": MODEL, "initial_peers": boot, "timing": TIMING,
            "models": {MODEL: {"num_layers": NUM_LAYERS, "activation_bytes": 4096, "solve_time_limit": 0.5}},
        }))
        procs.start("coordinator", ["-m", "p2pserve.cli", "coordinator", "--config", str(cfg_path), "--host-maddrs",
                                    "/ip4/127.0.0.1/tcp/0", "--replan-period", "1", "--max-peers-per-address", "1"])
        for name, (ip, tps) in PEERS.items():
            procs.start(name, ["-m", "p2pserve.testing.synthetic_peer", "--config", str(cfg_path), "--host-maddrs",
                               f"/ip4/{ip}/tcp/0", "--max-layers", "8", "--tps", str(tps), "--load-delay", "0.2",
                               "--no-probe", "--device", name, "--receipts", str(receipts)])
        ids = {name: wait_for(lambda n=name: _peer_id(procs, n), f"{name}'s peer id") for name in PEERS}
        # two clients: a peer counts as observed by reports from two reporters at least
        client, witness = (Swarm.create(DHTConfig(model=MODEL, swarm_id="claims-test", initial_peers=tuple(boot),
                                                  host_maddrs=("/ip4/127.0.0.1/tcp/0",), client_mode=True, **TIMING))
                           for _ in range(2))
        # each client was served by the three: it holds their receipts (a report counts only with one)
        for reporter in (client, witness):
            (receipts / f"client-{reporter.peer_id}").write_text("")

        def receipt(name, reporter):
            path = receipts / f"receipt-{ids[name]}-{reporter.peer_id}"
            return bytes.fromhex(path.read_text()) if path.exists() else None

        for reporter in (client, witness):
            # one session at 400 tok/s for one layer, 8 layers, batch 32: 400 / 8 / 32 tokens/s per session
            seen = [ObservedRate(peer_id=ids[n], layers=8, samples=64, rate=400 / 8 / 32, wall_rate=400 / 8 / 32 * 0.9,
                                 receipt=wait_for(lambda n=n: receipt(n, reporter), f"{n}'s receipt"))
                    for n in ("honest-1", "honest-2", "liar")]
            report = ServiceReports(model=MODEL, reporter_id=reporter.peer_id, rates=seen, timestamp=1.0)
            assert loop.run_until_complete(reporter.announce(RecordKind.REPORTS, report, ttl=300.0))

        def capped_plan():
            sp = loop.run_until_complete(client.get_plan())
            if sp is None:
                return None
            plan = sp.plan
            served = {n for n in PEERS if ids[n] in plan.spans}
            if not {"honest-1", "honest-2", "liar"} <= served:
                return None  # not settled yet
            return plan

        plan = wait_for(capped_plan, "a plan over the honest peers and the liar", timeout=90.0)
        inflow = {}
        for f in plan.flows:
            inflow[f.dst] = inflow.get(f.dst, 0.0) + f.rate
        total = sum(v for k, v in inflow.items() if k not in ("source", "sink"))
        # claims as announced would give the liar 5e6 / (5e6 + 800) of the flow; observed, at most
        # slack (2) x 400 against 800 honest tokens/s: half
        assert inflow.get(ids["liar"], 0.0) <= 0.5 * total + 1e-6
        sybils_in_plan = {n for n in ("sybil-1", "sybil-2") if ids[n] in plan.targets}
        assert len(sybils_in_plan) <= 1  # one peer per IP
        assert "capped" in procs.log("coordinator") or "left out" in procs.log("coordinator")

        peers = {pid: s.record for pid, s in loop.run_until_complete(client.get_peers()).items()}
        reports = [s.record for s in loop.run_until_complete(client.read(RecordKind.REPORTS, ServiceReports))]
        status = collect_status(peers, [], [], None, now=0.0, reports=reports)
        liar = next(p for p in status["peers"] if p["peer_id"] == ids["liar"])
        assert liar["effective_tps"] < liar["claimed_tps"] / 1000 and "reporters saw" in liar["claim"]
    finally:
        for swarm in (client, witness):
            if swarm is not None:
                swarm.shutdown()
        procs.close()
        loop.close()


def _peer_id(procs: Procs, name: str):
    ids = [line.split()[1] for line in procs.log(name).splitlines() if line.startswith("peer ")]
    return ids[-1] if ids else None
