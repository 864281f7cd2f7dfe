"""The coordinator's pure core: snapshot, re-plan decisions, targets, flows, plan changes."""

from p2pserve.placement.churn import layers_to_load
from p2pserve.coordinator.service import (
    CoordinatorConfig,
    Snapshot,
    Summary,
    decide_replan,
    make_plan,
    plan_changed,
)
from p2pserve.dht.records import LinkInfo, LinkStat, PeerInfo

CFG = CoordinatorConfig(num_layers=8, activation_bytes=1000, replan_period=60.0, solve_time_limit=0.3)


def peer(pid, k=4, serving=None, state=None, tps=100.0):
    state = state or ("serving" if serving else "joining")
    return PeerInfo(model="m", peer_id=pid, max_layers=k, throughput_decode=[tps / j for j in range(1, k + 1)],
                    serving=serving, state=state)


def plan_for(peers, links=(), current=None, epoch=1):
    snap = Snapshot.from_records({p.peer_id: p for p in peers}, list(links))
    return make_plan(snap, current or {}, epoch=epoch, leader_id="c", model="m", cfg=CFG, reason="t", now=1.0)


def test_initial_targets_cover_every_layer():
    plan = plan_for([peer("a"), peer("b"), peer("c"), peer("d")])
    assert set(plan.targets) == {"a", "b", "c", "d"}
    assert min(plan.coverage(use_targets=True)) >= 1
    assert plan.flows == [] and plan.max_flow == 0.0  # nobody serves yet: no routes
    plan.validate()


def test_flows_only_over_served_ranges():
    peers = [peer("a", serving=(0, 4)), peer("b", serving=(4, 8)), peer("c")]  # c is still joining
    plan = plan_for(peers, current={"a": (0, 4), "b": (4, 8)})
    assert set(plan.spans) == {"a", "b"}
    names = {f.src for f in plan.flows} | {f.dst for f in plan.flows}
    assert "c" not in names and {"source", "sink", "a", "b"} <= names
    assert plan.max_flow == 25.0  # T[4] = 100/4
    # a and b load nothing new (they may shed layers to the newcomer: shrinking is free)
    kept = {p: plan.targets[p] for p in ("a", "b")}
    assert layers_to_load({"a": (0, 4), "b": (4, 8)}, kept) == 0
    assert "c" in plan.targets
    plan.validate()


def test_departure_keeps_others_and_reassigns_hole():
    cur = {"a": (0, 4), "b": (4, 8), "c": (0, 4), "d": (4, 8)}
    plan = plan_for([peer("a"), peer("b"), peer("c")], current=cur)
    assert "d" not in plan.targets
    assert plan.targets == {"a": (0, 4), "b": (4, 8), "c": (0, 4)}  # still covered: nobody moves
    plan2 = plan_for([peer("a"), peer("c")], current=cur)  # layers 4..8 lost: re-place
    assert min(plan2.coverage(use_targets=True)) >= 1


def test_draining_and_unprofiled_peers_get_nothing():
    p = PeerInfo(model="m", peer_id="x", max_layers=0)
    plan = plan_for([peer("a", k=8), peer("b", serving=(0, 4), state="draining"), p])
    assert set(plan.targets) == {"a"} and "b" not in plan.spans


def test_links_measured_or_defaulted():
    peers = [peer("a", serving=(0, 4)), peer("b", serving=(4, 8)), peer("c", serving=(4, 8))]
    links = [LinkInfo(model="m", peer_id="a", links={"b": LinkStat(bandwidth=1e4, rtt=0.01)})]
    plan = plan_for(peers, links, current={"a": (0, 4), "b": (4, 8), "c": (4, 8)})
    assert ("a", "c") in plan.defaulted_links and ("a", "b") not in plan.defaulted_links
    rates = {(f.src, f.dst): f.rate for f in plan.flows}
    assert rates.get(("a", "b"), 0.0) <= 1e4 / 1000 + 1e-9  # 10 tokens/s over a 10 kB/s link


def test_decide_replan():
    s0 = Summary.of(Snapshot.from_records({"a": peer("a")}, []))
    assert decide_replan(None, s0, 0.0, None, CFG) == "initial"
    assert decide_replan(s0, s0, 10.0, 5.0, CFG) is None
    assert decide_replan(s0, s0, 70.0, 5.0, CFG) == "periodic"
    s1 = Summary.of(Snapshot.from_records({"a": peer("a"), "b": peer("b")}, []))
    assert decide_replan(s0, s1, 10.0, 5.0, CFG).startswith("join")
    assert decide_replan(s1, s0, 10.0, 5.0, CFG).startswith("leave")
    s2 = Summary.of(Snapshot.from_records({"a": peer("a", serving=(0, 4))}, []))
    assert decide_replan(s0, s2, 10.0, 5.0, CFG) == "served ranges changed"
    peers = {"a": peer("a"), "b": peer("b")}
    l1 = Summary.of(Snapshot.from_records(peers, [LinkInfo(model="m", peer_id="a", links={"b": LinkStat(bandwidth=100.0, rtt=0.0)})]))
    l2 = Summary.of(Snapshot.from_records(peers, [LinkInfo(model="m", peer_id="a", links={"b": LinkStat(bandwidth=120.0, rtt=0.0)})]))
    l3 = Summary.of(Snapshot.from_records(peers, [LinkInfo(model="m", peer_id="a", links={"b": LinkStat(bandwidth=200.0, rtt=0.0)})]))
    assert decide_replan(l1, l2, 10.0, 5.0, CFG) is None  # +20% < threshold
    assert decide_replan(l1, l3, 10.0, 5.0, CFG).startswith("link")
    # with 1000-byte activations a peer of 100 tok/s can use 1e5 B/s at most: faster links
    # changing (by any factor) cannot change a plan
    f1, f2, f3 = (Summary.of(Snapshot.from_records(peers, [LinkInfo(model="m", peer_id="a", links={
        "b": LinkStat(bandwidth=bw, rtt=0.0)})]), 1000) for bw in (2e5, 9e5, 5e4))
    assert f1.link_ceiling == 1e5
    assert decide_replan(f1, f2, 10.0, 5.0, CFG) is None
    assert decide_replan(f1, f3, 10.0, 5.0, CFG).startswith("link")  # now it can bind


def test_plan_changed():
    peers = [peer("a", serving=(0, 8), k=8)]
    p1 = plan_for(peers, current={"a": (0, 8)})
    p2 = plan_for(peers, current={"a": (0, 8)}, epoch=9)
    assert not plan_changed(p1, p2)
    assert plan_changed(None, p1)
    p3 = plan_for([peer("a", serving=(0, 8), k=8, tps=200.0)], current={"a": (0, 8)})
    assert plan_changed(p1, p3)


def test_swarm_too_small_falls_back_and_logs(caplog):
    plan = plan_for([peer("a", k=4)])  # 4 layers of memory for an 8-layer model
    assert plan.targets == {"a": (0, 4)}
    assert "greedy" in plan.reason


def test_idle_peers_get_a_replica():
    from p2pserve.coordinator.service import build_topology, fill_idle

    snap = Snapshot.from_records({p: peer(p) for p in "abc"}, [])
    topo, _ = build_topology(snap, ["a", "b", "c"], CFG)
    out = fill_idle(topo, ["a", "b", "c"], {"a": (0, 4), "b": (4, 8)})
    assert out["a"] == (0, 4) and out["b"] == (4, 8) and out["c"][1] - out["c"][0] == 4
