"""The publish guard in the coordinator: a check built from the round's own topology
(no cluster file) screens the full solve; a topology that cannot be simulated plans without it."""

from __future__ import annotations

from p2pserve.config import CoordinatorConfig
from p2pserve.coordinator.plan_record import make_plan
from p2pserve.coordinator.snapshot import Snapshot
from p2pserve.coordinator.claims import scaled
from p2pserve.coordinator.targets import _guard_move, build_topology, plan_targets
from p2pserve.coordinator.trigger import Reason, Trigger
from p2pserve.dht.records import LatencyPoints, PeerInfo
from p2pserve.helix.root import data_root
from p2pserve.helix.topology import load_helix_topology
from p2pserve.placement.heuristics import coverage
from p2pserve.sim.plan_check import live_check, simulable

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
    targets, method, _ = plan_targets(topo, ids, {}, cfg, check=check)
    assert "guard kept" in method and "guard kept final" not in method, method
    assert min(coverage(80, targets.values())) >= 1


def test_live_peers_without_profiles_plan_without_the_guard():
    """Older peers announce throughputs but no per-layer latency points or KV entry size: the
    factory sees the round's topology, declines it, and the plan is made as before."""
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


def _announcing(pid: str, ms: float, kv_tokens: int = 200_000, max_layers: int = 4) -> PeerInfo:
    """A peer that announces its per-layer latency points and KV capacity (as the profiler's
    figures: ``ms`` per layer for a lone token, 8x for a 128-token prompt, 3x for a 32-batch)."""
    return PeerInfo(model="m", peer_id=pid, max_layers=max_layers,
                    throughput_decode=[32.0 / (j * 3 * ms / 1e3) for j in range(1, max_layers + 1)],
                    latency=LatencyPoints(prompt=[(1.0, ms), (128.0, 8 * ms)], decode=[(1.0, ms), (32.0, 3 * ms)]),
                    kv_entry_bytes=1024, kv_memory_bytes=kv_tokens * 1024)


def test_peers_announcing_latency_and_kv_make_a_simulable_topology_and_the_guard_runs():
    """Peers announcing latency points and KV entry size: the round's topology carries a profile
    and KV capacity per node, the factory builds a simulation, and the full solve goes through it."""
    peers = {p: _announcing(p, ms) for p, ms in (("a", 2.0), ("b", 2.0), ("c", 4.0))}
    snap = Snapshot.from_records(peers, [])
    cfg = CoordinatorConfig(num_layers=8, activation_bytes=1000, solve_time_limit=0.3)
    topo, _ = build_topology(snap, ["a", "b", "c"], cfg)
    assert simulable(topo)
    assert topo.nodes[2].profile.decode_ms(32) == 12.0 and topo.nodes[0].kv_capacity[3] == 200_000
    plan = make_plan(snap, {}, epoch=1, leader_id="c", model="m", cfg=cfg, reason=Reason(Trigger.INITIAL, "t"),
                     now=1.0, plan_check=live_check(duration=30.0, warmup=10.0))
    assert "guard kept" in plan.reason, plan.reason
    assert min(plan.coverage(use_targets=True)) >= 1


def test_a_churn_move_the_simulation_ranks_below_the_current_placement_is_not_published():
    """A re-solve after a join proposes layer moves; the guard compares them with the current
    placement by the check and keeps the current one when it is not worse."""
    peers = {p: _announcing(p, 2.0) for p in ("a", "b", "c")}
    topo, _ = build_topology(Snapshot.from_records(peers, []), ["a", "b", "c"],
                             CoordinatorConfig(num_layers=8, activation_bytes=1000))
    current = {0: (0, 4), 1: (4, 8)}
    moved = {0: (0, 3), 1: (3, 6), 2: (6, 8)}
    kept, was_kept = _guard_move(topo, current, moved, lambda p: 10.0 if dict(p) == current else 5.0)
    assert was_kept and kept == current
    kept, was_kept = _guard_move(topo, current, moved, lambda p: 5.0 if dict(p) == current else 10.0)
    assert not was_kept and kept == moved
    # a current placement with a hole is no alternative: the move goes out
    kept, was_kept = _guard_move(topo, {0: (0, 4)}, moved, lambda p: 1e9)
    assert not was_kept and kept == moved


def test_claims_scaled_down_slow_the_announced_latency_too():
    """A peer observed at half its claim is simulated at half speed: its latency points double."""
    p = _announcing("a", 2.0)
    half = scaled(p, 0.5)
    assert half.latency.decode == [(1.0, 4.0), (32.0, 12.0)]
    assert half.throughput_decode[0] == p.throughput_decode[0] * 0.5
