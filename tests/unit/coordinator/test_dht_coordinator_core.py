"""The coordinator's pure core: snapshot, re-plan decisions, targets, flows, plan changes."""

from p2pserve.config import CoordinatorConfig
from p2pserve.coordinator.plan_record import compute_flows, make_plan, plan_changed, planner_limit
from p2pserve.coordinator.replan import decide_replan
from p2pserve.coordinator.snapshot import Snapshot, Summary
from p2pserve.coordinator.trigger import Reason, Trigger
from p2pserve.dht.records import LinkInfo, LinkStat, PeerInfo
from p2pserve.placement.churn import layers_to_load

CFG = CoordinatorConfig(num_layers=8, activation_bytes=1000, replan_period=60.0, solve_time_limit=0.3)


def peer(pid, k=4, serving=None, state=None, tps=100.0):
    state = state or ("serving" if serving else "joining")
    return PeerInfo(model="m", peer_id=pid, max_layers=k, throughput_decode=[tps / j for j in range(1, k + 1)],
                    serving=serving, state=state)


def plan_for(peers, links=(), current=None, epoch=1):
    snap = Snapshot.from_records({p.peer_id: p for p in peers}, list(links))
    return make_plan(snap, current or {}, epoch=epoch, leader_id="c", model="m", cfg=CFG,
                     reason=Reason(Trigger.INITIAL, "t"), now=1.0)


def test_initial_targets_cover_every_layer():
    plan = plan_for([peer("a"), peer("b"), peer("c"), peer("d")])
    assert set(plan.targets) == {"a", "b", "c", "d"}
    assert min(plan.coverage(use_targets=True)) >= 1
    assert plan.flows == [] and plan.max_flow == 0.0  # nobody serves yet: no routes
    plan.validate()


def test_the_planner_gets_what_the_rest_of_the_solve_left_of_its_limit():
    assert planner_limit(5.0, 1.0) == 4.0
    assert planner_limit(5.0, 0.0) == 5.0
    assert planner_limit(5.0, 4.9) == 1.25  # never below a quarter: a valid plan needs some search


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


def test_a_swarm_planned_in_cells_routes_inside_them():
    peers = [peer("a", serving=(0, 4)), peer("b", serving=(4, 8)), peer("c", serving=(0, 4)),
             peer("d", serving=(4, 8)), peer("e", serving=(0, 4))]
    snap = Snapshot.from_records({p.peer_id: p for p in peers}, [])
    _, value, _, _, _ = compute_flows(snap, CFG)  # one max-flow over everyone (may cross the cells)
    cells = {"a": "c0", "b": "c0", "c": "c1", "d": "c1", "e": "c2"}  # c2 holds half the model
    flows, by_cells, _, _, _ = compute_flows(snap, CFG, cells)
    for f in flows:
        if "source" not in (f.src, f.dst) and "sink" not in (f.src, f.dst):
            assert cells[f.src] == cells[f.dst]
    assert by_cells == value == 50.0  # two pipelines of T[4] = 25 either way; e pooled alone carries nothing
    assert "e" not in {f.src for f in flows} | {f.dst for f in flows}


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


def why(*args):
    """decide_replan's reason as (trigger, text), or None."""
    r = decide_replan(*args)
    return None if r is None else (r.trigger, str(r))


def test_decide_replan():
    s0 = Summary.of(Snapshot.from_records({"a": peer("a")}, []))
    assert why(None, s0, 0.0, None, CFG) == (Trigger.INITIAL, "initial")
    assert why(s0, s0, 10.0, 5.0, CFG) is None
    assert why(s0, s0, 70.0, 5.0, CFG) == (Trigger.PERIODIC, "periodic")
    s1 = Summary.of(Snapshot.from_records({"a": peer("a"), "b": peer("b")}, []))
    assert why(s0, s1, 10.0, 5.0, CFG)[0] is Trigger.MEMBERSHIP and why(s0, s1, 10.0, 5.0, CFG)[1].startswith("join")
    assert why(s1, s0, 10.0, 5.0, CFG)[0] is Trigger.MEMBERSHIP and why(s1, s0, 10.0, 5.0, CFG)[1].startswith("leave")
    s2 = Summary.of(Snapshot.from_records({"a": peer("a", serving=(0, 4))}, []))
    assert why(s0, s2, 10.0, 5.0, CFG) == (Trigger.SERVED_RANGES, "served ranges changed")
    peers = {"a": peer("a"), "b": peer("b")}
    l1 = Summary.of(Snapshot.from_records(peers, [LinkInfo(model="m", peer_id="a", links={"b": LinkStat(bandwidth=100.0, rtt=0.0)})]))
    l2 = Summary.of(Snapshot.from_records(peers, [LinkInfo(model="m", peer_id="a", links={"b": LinkStat(bandwidth=120.0, rtt=0.0)})]))
    l3 = Summary.of(Snapshot.from_records(peers, [LinkInfo(model="m", peer_id="a", links={"b": LinkStat(bandwidth=200.0, rtt=0.0)})]))
    assert why(l1, l2, 10.0, 5.0, CFG) is None  # +20% < threshold
    assert why(l1, l3, 10.0, 5.0, CFG)[0] is Trigger.LINK and why(l1, l3, 10.0, 5.0, CFG)[1].startswith("link")
    # with 1000-byte activations a peer of 100 tok/s can use 1e5 B/s at most: faster links
    # changing (by any factor) cannot change a plan
    f1, f2, f3 = (Summary.of(Snapshot.from_records(peers, [LinkInfo(model="m", peer_id="a", links={
        "b": LinkStat(bandwidth=bw, rtt=0.0)})]), 1000) for bw in (2e5, 9e5, 5e4))
    assert f1.link_ceiling == 1e5
    assert why(f1, f2, 10.0, 5.0, CFG) is None
    assert why(f1, f3, 10.0, 5.0, CFG)[0] is Trigger.LINK  # now it can bind


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
    from p2pserve.coordinator.targets import build_topology, replicate_idle

    snap = Snapshot.from_records({p: peer(p) for p in "abc"}, [])
    topo, _ = build_topology(snap, ["a", "b", "c"], CFG)
    out = replicate_idle(topo, ["a", "b", "c"], {"a": (0, 4), "b": (4, 8)})
    assert out["a"] == (0, 4) and out["b"] == (4, 8) and out["c"][1] - out["c"][0] == 4


def test_replan_takeover_keeps_the_placement_and_epochs_only_move_up():
    from p2pserve.coordinator.plan_record import with_epoch
    from p2pserve.coordinator.replan import LeaderState, replan

    peers = [peer("a", serving=(0, 4)), peer("b", serving=(4, 8))]
    snap = Snapshot.from_records({p.peer_id: p for p in peers}, [])
    old = plan_for(peers, current={"a": (0, 4), "b": (4, 8)}, epoch=7)

    def round_(state, latest, now, elected=False):
        return replan(snap, state, elected=elected, latest_seen=latest, now=now, cfg=CFG, leader_id="c2", model="m")

    d = round_(LeaderState(), old, 10.0, elected=True)
    assert d.reason.trigger is Trigger.ELECTED and d.publish.epoch == 8 and d.publish.targets == old.targets
    assert d.publish.leader_id == "c2" and d.state.plan == d.publish
    # nothing changed: no re-plan, nothing to publish, the state stays
    d2 = round_(d.state, d.publish, 11.0)
    assert d2.reason is None and d2.publish is None and d2.state == d.state
    # another leader published a higher epoch: publish above it, same content
    d3 = round_(d.state, with_epoch(d.publish, 12), 12.0)
    assert d3.reason.trigger is Trigger.SAW_EPOCH and d3.publish.epoch == 13 and d3.publish.targets == old.targets
    # the periodic re-plan finds the same plan: no new epoch (the service only refreshes it)
    d4 = round_(d3.state, d3.publish, 12.0 + CFG.replan_period)
    assert d4.reason.trigger is Trigger.PERIODIC and d4.publish is None
    assert d4.state.plan.epoch == 13 and d4.state.planned_at == 12.0 + CFG.replan_period
