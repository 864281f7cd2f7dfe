"""The publish guard in the coordinator (issue 17): a check built from the round's own topology
(no cluster file) screens the full solve; a topology that cannot be simulated plans without it."""

from __future__ import annotations

from p2pserve.config import CoordinatorConfig
from p2pserve.coordinator.plan_record import make_plan
from p2pserve.coordinator.snapshot import Snapshot
from p2pserve.coordinator.targets import plan_targets
from p2pserve.coordinator.trigger import Reason, Trigger
from p2pserve.dht.records import PeerInfo
from p2pserve.helix.root import data_root
from p2pserve.helix.topology import load_helix_topology
from p2pserve.placement.heuristics import coverage
from p2pserve.sim.plan_check import live_check

GEO = "clusters/distributed/cluster24_geo.ini"


def test_plan_targets_guard_overrules_the_geo_chain():
    """On the geo-distributed cluster Helix's max-flow objective finds a chain through every node
    that crosses 50 ms region boundaries; the check built from the topology alone serves it at next
    to nothing, and the coordinator's full solve keeps a baseline instead."""
    topo = load_helix_topology(data_root() / GEO, "llama2-70b")
    ids = [n.name for n in topo.nodes]
    cfg = CoordinatorConfig(num_layers=80, objective="max-flow", solve_time_limit=1.0)
    check = live_check(duration=30.0, warmup=15.0)(topo)
    assert check is not None
    targets, method = plan_targets(topo, ids, {}, cfg, check=check)
    assert "guard kept" in method and "guard kept final" not in method, method
    assert min(coverage(80, targets.values())) >= 1


def test_live_peers_without_profiles_plan_without_the_guard():
    """Today's peers announce throughputs but no per-layer latency profile or KV capacity per
    depth: the factory sees the round's topology, declines it, and the plan is made as before."""
    seen = []

    def factory(topo):
        seen.append(topo)
        return live_check()(topo)

    peers = {p: PeerInfo(model="m", peer_id=p, max_layers=4, throughput_decode=[100.0 / j for j in range(1, 5)])
             for p in ("a", "b", "c")}
    cfg = CoordinatorConfig(num_layers=8, activation_bytes=1000, solve_time_limit=0.3)
    plan = make_plan(Snapshot.from_records(peers, []), {}, epoch=1, leader_id="c", model="m", cfg=cfg,
                     reason=Reason(Trigger.INITIAL, "t"), now=1.0, plan_check=factory)
    assert len(seen) == 1 and seen[0].num_nodes == 3
    assert "guard" not in plan.reason
    assert min(plan.coverage(use_targets=True)) >= 1
