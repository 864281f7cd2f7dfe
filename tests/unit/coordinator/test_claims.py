"""Claims checked against observed service rates, and per-address caps (coordinator/claims.py).

Reproduces the attack first: one peer claiming 1e8 tokens/s among honest peers takes
almost all of the plan's flow; with reports from clients that used it, it plans at what they
saw. The pure policy runs on records built here; the coordinator hook runs on ``FakeSwarm``.
"""

from __future__ import annotations

import asyncio
import hashlib

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from p2pserve.config import CoordinatorConfig, DHTConfig
from p2pserve.coordinator import claims
from p2pserve.coordinator.plan_record import make_plan
from p2pserve.coordinator.service import CoordinatorService
from p2pserve.coordinator.snapshot import Snapshot
from p2pserve.coordinator.trigger import Reason, Trigger
from p2pserve.dht.evidence import reply_key_text
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.receipts import sign_receipt
from p2pserve.dht.records import MAX_TOKENS_PER_S, PeerInfo
from p2pserve.dht.reports import ObservedRate, ServiceReports
from p2pserve.errors import RecordRejected
from p2pserve.testing import FakeClock, FakeSwarm, FakeSwarmStore

CFG = CoordinatorConfig(num_layers=8, activation_bytes=1000, solve_time_limit=0.3)
OFF = CoordinatorConfig(num_layers=8, activation_bytes=1000, solve_time_limit=0.3, check_claims=False)


def key_of(pid):
    """The peer's reply key (seeded by its id: the same in every test)."""
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(pid.encode()).digest())


def peer(pid, tps=50.0, k=8, serving=(0, 8), ip="10.0.0.1"):
    return PeerInfo(model="m", peer_id=pid, max_layers=k, throughput_decode=[tps / j for j in range(1, k + 1)],
                    serving=serving, state="serving" if serving else "joining", reply_key=reply_key_text(key_of(pid)),
                    addrs=[f"/ip4/{ip}/tcp/4000/p2p/{pid}", f"/ip4/127.0.0.1/tcp/4000/p2p/{pid}"])


def seen(pid, per_session, layers=8, samples=32, rtt_share=0.0):
    """What a client reports after ``samples`` decode steps at ``per_session`` tokens/s of service."""
    return ObservedRate(peer_id=pid, layers=layers, samples=samples, rate=per_session,
                        wall_rate=per_session * (1 - rtt_share), observed_at=1.0)


def report(reporter, *rates, ip=None, receipts=True):
    """``reporter``'s record; with ``receipts``, each entry carries the peer's receipt for it (a
    client that was served)."""
    addrs = [f"/ip4/{ip}/tcp/1/p2p/{reporter}"] if ip else []
    if receipts:
        rates = [msgspec.structs.replace(r, receipt=sign_receipt(key_of(r.peer_id), r.peer_id, reporter)) for r in rates]
    return ServiceReports(model="m", reporter_id=reporter, addrs=addrs, rates=list(rates), timestamp=1.0)


def two_reports(*rates):
    """The same observations from two clients at two addresses (the fewest that count)."""
    return [report(f"c{i}", *rates, ip=f"192.0.2.{i}") for i in (1, 2)]


def honest_rate(tps, layers=8, batch=32):
    """A per-session rate consistent with an honest claim of ``tps`` (one layer) at full batch."""
    return tps / layers / batch


def share(plan, pids):
    inflow = {}
    for f in plan.flows:
        if f.dst not in ("source", "sink"):
            inflow[f.dst] = inflow.get(f.dst, 0.0) + f.rate
    return sum(inflow.get(p, 0.0) for p in pids) / sum(inflow.values())


def plan_of(snap, cfg=CFG):
    return make_plan(snap, {pid: p.serving for pid, p in snap.peers.items()}, epoch=1, leader_id="c", model="m",
                     cfg=cfg, reason=Reason(Trigger.INITIAL), now=1.0)


def swarm_with_liar():
    honest = [peer(f"h{i}", ip=f"10.0.0.{i}") for i in range(1, 5)]
    liar = peer("liar", tps=MAX_TOKENS_PER_S, ip="10.0.0.66")
    return Snapshot({p.peer_id: p for p in honest + [liar]})


def test_an_inflated_claim_takes_the_flow_without_the_policy():
    plan = plan_of(swarm_with_liar(), OFF)
    assert share(plan, ["liar"]) > 0.95  # one liar, almost all of the flow


def test_an_inflated_claim_is_capped_at_what_clients_observed():
    snap = swarm_with_liar()
    # three clients used every peer; the liar's hardware is as fast as the others'
    reps = [report(f"c{i}", *[seen(p, honest_rate(50.0)) for p in snap.peers], ip=f"192.0.2.{i}") for i in range(3)]
    capped, found = claims.police(snap, reps, CFG)
    v = found["liar"]
    assert v.reason == "observed" and v.capped and v.reporters == 3
    assert v.effective == pytest.approx(50.0 * CFG.claim_slack)
    assert not found["h1"].capped  # an honest claim stands
    assert capped.peers["h1"] == snap.peers["h1"]
    assert share(plan_of(capped), ["liar"]) < 0.5


def test_a_peer_observed_far_below_its_claim_loses_flow():
    snap = Snapshot({p.peer_id: p for p in [peer("a", ip="10.0.0.1"), peer("b", ip="10.0.0.2")]})
    reps = two_reports(seen("a", honest_rate(50.0)), seen("b", honest_rate(5.0)))
    capped, found = claims.police(snap, reps, CFG)
    assert found["b"].effective == pytest.approx(5.0 * CFG.claim_slack) and not found["a"].capped
    assert capped.peers["b"].throughput_decode[0] == pytest.approx(10.0)


def test_an_unobserved_peer_is_capped_at_the_median_of_observed_ones():
    snap = swarm_with_liar()
    reps = two_reports(*[seen(f"h{i}", honest_rate(50.0)) for i in range(1, 5)])
    capped, found = claims.police(snap, reps, CFG)
    assert found["liar"].reason == "unobserved" and found["liar"].effective == pytest.approx(50.0)
    assert 0 < share(plan_of(capped), ["liar"]) < 0.5  # some flow: it can get used and observed


def test_a_cold_swarm_keeps_honest_claims_and_caps_an_outlier_at_a_multiple_of_the_median():
    snap = swarm_with_liar()
    capped, found = claims.police(snap, [], CFG)
    assert all(capped.peers[f"h{i}"] == snap.peers[f"h{i}"] for i in range(1, 5))
    assert found["liar"].reason == "cold" and found["liar"].effective == pytest.approx(50.0 * CFG.cold_claim_slack)
    assert share(plan_of(capped), ["liar"]) < 0.75  # before: > 0.95


def test_a_sybil_flood_of_unobserved_peers_shares_one_newcomers_budget():
    honest = [peer(f"h{i}", ip=f"10.0.0.{i}") for i in range(1, 5)]
    sybils = [peer(f"s{i}", tps=MAX_TOKENS_PER_S, ip=f"10.1.{i}.1") for i in range(100)]
    snap = Snapshot({p.peer_id: p for p in honest + sybils})
    reps = two_reports(*[seen(p.peer_id, honest_rate(50.0)) for p in honest])
    capped, found = claims.police(snap, reps, CFG)
    total = sum(found[p.peer_id].effective for p in sybils)
    assert total == pytest.approx(CFG.unobserved_total_share * 4 * 50.0)
    assert all(found[p.peer_id].effective > 0 for p in sybils)  # each still gets a chance to be observed


def test_few_samples_do_not_count():
    snap = swarm_with_liar()
    reps = two_reports(seen("liar", honest_rate(50.0), samples=CFG.min_report_samples - 1),
                       seen("h1", honest_rate(50.0)))
    _, found = claims.police(snap, reps, CFG)
    assert found["liar"].reason == "unobserved"


def test_one_address_alone_neither_vouches_nor_defames():
    snap = swarm_with_liar()
    sybils = [report(f"s{i}", seen("liar", 1e6), seen("h1", 1e-3), ip="203.0.113.9") for i in range(20)]
    honest = two_reports(*[seen(f"h{i}", honest_rate(50.0)) for i in range(1, 5)])
    _, found = claims.police(snap, sybils + honest, CFG)
    assert found["liar"].reason == "unobserved" and found["liar"].effective <= 50.0
    assert not found["h1"].capped  # one address against two: the median of three stays honest


def test_sybil_reporters_from_one_address_count_once():
    snap = swarm_with_liar()
    sybils = [report(f"s{i}", seen("liar", 1e6), ip="203.0.113.9") for i in range(20)]
    honest = [report(f"c{i}", seen("liar", honest_rate(50.0)), ip=f"192.0.2.{i}") for i in range(2)]
    _, found = claims.police(snap, sybils + honest, CFG)
    assert found["liar"].reporters == 3 and found["liar"].effective == pytest.approx(50.0 * CFG.claim_slack)


def test_the_rtt_correction_is_bounded_by_the_wall_clock_rate():
    """A peer that stalls its OpenSession replies makes the RTT look long and its service short."""
    snap = swarm_with_liar()
    reps = two_reports(seen("liar", 1e5, rtt_share=0.999))
    _, found = claims.police(snap, reps, CFG)
    wall = 1e5 * 0.001
    assert found["liar"].effective == pytest.approx(wall * CFG.max_rtt_credit * CFG.claim_batch * 8 * CFG.claim_slack)


def test_at_most_n_peers_per_address_get_flow():
    honest = [peer(f"h{i}", ip=f"10.0.0.{i}") for i in range(1, 4)]
    sybils = [peer(f"s{i:02d}", tps=1e6, ip="203.0.113.9") for i in range(10)]
    snap = Snapshot({p.peer_id: p for p in honest + sybils})
    cfg = CoordinatorConfig(num_layers=8, max_peers_per_address=2, check_claims=False, solve_time_limit=0.3)
    capped, found = claims.police(snap, [], cfg)
    assert set(capped.peers) == {"h1", "h2", "h3", "s00", "s01"}
    assert found["s05"].reason == "address cap" and "203.0.113.9" in claims.cap_per_address(snap.peers, 2)[1]["s05"]
    plan = plan_of(capped, cfg)
    assert not {f.dst for f in plan.flows} & {f"s{i:02d}" for i in range(2, 10)}


def test_address_keys_ignore_loopback_and_relays_but_keep_a_loopback_only_peer():
    assert claims.address_keys(["/ip4/127.0.0.1/tcp/1", "/ip4/198.51.100.7/tcp/1/p2p/x"]) == {"198.51.100.7"}
    assert claims.address_keys(["/ip4/127.0.0.2/tcp/1"]) == {"127.0.0.2"}
    assert claims.address_keys(["/ip4/198.51.100.1/tcp/1/p2p/R/p2p-circuit/p2p/x"]) == frozenset()
    assert claims.address_keys(["/ip6/2001:db8::1/tcp/1", "/dns4/example.org/tcp/1", "garbage"]) == {"2001:db8::1"}


def test_a_lower_claim_keeps_its_place_at_a_shared_address():
    """Sybils announcing an honest peer's IP cannot push it out: inflated claims queue last."""
    victim = peer("v", tps=50.0, ip="10.0.0.5", serving=None)
    squatters = [peer(f"s{i}", tps=1e5, ip="10.0.0.5", serving=None) for i in range(5)]
    kept, dropped = claims.cap_per_address({p.peer_id: p for p in [victim, *squatters]}, 1)
    assert set(kept) == {"v"} and len(dropped) == 5


@pytest.mark.parametrize("bad", [
    dict(rates=[ObservedRate(peer_id="me", layers=1, samples=1, rate=1.0, wall_rate=1.0)]),
    dict(rates=[ObservedRate(peer_id="x", layers=1, samples=1, rate=1.0, wall_rate=2.0)]),
    dict(rates=[ObservedRate(peer_id="x", layers=1, samples=1, rate=float("nan"), wall_rate=1.0)]),
    dict(rates=[ObservedRate(peer_id="x", layers=1, samples=1, rate=2e8, wall_rate=1.0)]),
    dict(rates=[ObservedRate(peer_id="x", layers=0, samples=1, rate=1.0, wall_rate=1.0)]),
    dict(rates=[ObservedRate(peer_id="x", layers=1, samples=1, rate=1.0, wall_rate=1.0)] * 2),
    dict(reporter_id=""),
    dict(addrs=["/ip4/1.2.3.4/tcp/1"] * 33),
])
def test_absurd_reports_are_rejected(bad):
    kw = dict(model="m", reporter_id="me", rates=[])
    with pytest.raises(RecordRejected):
        ServiceReports(**{**kw, **bad}).validate()


def test_the_coordinator_plans_with_capped_claims():
    store, clock = FakeSwarmStore(), FakeClock()
    dcfg = DHTConfig(model="m", candidate_refresh=1.0, max_clock_skew=0.0)
    coord_swarm = FakeSwarm(store, "coord", dcfg)
    for p in swarm_with_liar().peers.values():
        asyncio.run(FakeSwarm(store, p.peer_id, dcfg).announce_peer(p))
    for i in range(3):
        rep = report(f"c{i}", *[seen(p, honest_rate(50.0)) for p in ["liar", "h1", "h2"]], ip=f"192.0.2.{i}")
        asyncio.run(FakeSwarm(store, f"c{i}", dcfg).announce(RecordKind.REPORTS, rep))
    coord = CoordinatorService(coord_swarm, CoordinatorConfig(num_layers=8, priority=1, solve_time_limit=0.3, tick=0.01),
                               clock=clock)

    async def go():
        clock.advance(2.5)
        return await coord.step()

    assert asyncio.run(go()).startswith("published")
    plan = store.get(RecordKind.PLAN, coord_swarm.public_key)
    assert share(plan, ["liar"]) < 0.5
    assert coord.verdicts["liar"].capped and coord.verdicts["liar"].reporters == 3


def test_status_shows_claimed_against_effective_and_why():
    from p2pserve.cli.status import collect_status, format_status

    snap = swarm_with_liar()
    reps = two_reports(*[seen(p, honest_rate(50.0)) for p in snap.peers])
    d = collect_status(dict(snap.peers), [], [], None, now=1.0, reports=reps)
    liar = next(p for p in d["peers"] if p["peer_id"] == "liar")
    assert liar["claimed_tps"] == MAX_TOKENS_PER_S and liar["effective_tps"] == pytest.approx(100.0)
    assert "capped" in liar["claim"] and "2 reporters" in liar["claim"]
    text = format_status(d)
    assert "CLAIMS" in text and "1 capped" in text


def flat(pid, tps, k=8, ip="10.0.0.1"):
    """A peer claiming its one-layer rate for every layer count (a flat table)."""
    p = peer(pid, tps, k, ip=ip)
    return PeerInfo(**{**{f: getattr(p, f) for f in p.__struct_fields__}, "throughput_decode": [tps] * k})


def test_newcomers_caps_bind_the_whole_table_so_flat_tables_gain_nothing():
    honest = [peer(f"h{i}", ip=f"10.0.0.{i}") for i in range(1, 5)]
    reps = two_reports(*[seen(p.peer_id, honest_rate(50.0)) for p in honest])
    shares = {}
    for name, make in (("shaped", peer), ("flat", flat)):
        sybils = [make(f"s{i}", MAX_TOKENS_PER_S, ip=f"10.1.{i}.1") for i in range(10)]
        snap = Snapshot({p.peer_id: p for p in honest + sybils})
        capped, found = claims.police(snap, reps, CFG)
        shares[name] = share(plan_of(capped), [p.peer_id for p in sybils])
        for p in sybils:  # every entry of the table is within the newcomers' reference, not only the first
            ref = found[p.peer_id].ceiling
            assert all(t <= r * (1 + 1e-9) for t, r in zip(capped.peers[p.peer_id].throughput_decode, ref))
    assert shares["flat"] <= shares["shaped"] + 1e-6, shares


def test_a_cold_swarms_cap_binds_the_whole_table_too():
    honest = [peer(f"h{i}", ip=f"10.0.0.{i}") for i in range(1, 5)]
    liar = flat("liar", MAX_TOKENS_PER_S, ip="10.0.0.66")
    capped, found = claims.police(Snapshot({p.peer_id: p for p in honest + [liar]}), [], CFG)
    table = capped.peers["liar"].throughput_decode
    assert table[-1] <= CFG.cold_claim_slack * 50.0 / 8 * (1 + 1e-9)  # not the one-layer cap at 8 layers


def test_reports_count_only_with_the_reported_peers_receipt_for_the_reporter():
    """Two throwaway reporters at two addresses report an unprobed peer at rate 0: with no receipt
    (they were never served), or with a receipt the peer gave someone else, they count for
    nothing and the peer stays as claimed (cold); with its receipts they count."""
    peers = {"p": peer("p"), "q": peer("q")}
    zero = seen("p", 0.0)
    bare = [report(f"sybil{i}", zero, ip=f"198.51.100.{i}", receipts=False) for i in (1, 2)]
    stolen_receipt = sign_receipt(key_of("p"), "p", "honest-client")
    stolen = [report(f"sybil{i}", msgspec.structs.replace(zero, receipt=stolen_receipt), ip=f"198.51.100.{i}",
                     receipts=False) for i in (1, 2)]
    other_key = [report(f"sybil{i}", msgspec.structs.replace(zero, receipt=sign_receipt(key_of("q"), "p", f"sybil{i}")),
                        ip=f"198.51.100.{i}", receipts=False) for i in (1, 2)]
    served = [report(f"client{i}", zero, ip=f"198.51.100.{i}") for i in (1, 2)]
    for fake in (bare, stolen, other_key):
        v = claims.verdicts(peers, fake, CFG)
        assert v["p"].reason == "cold" and v["p"].effective == v["p"].claimed > 0
    assert claims.verdicts(peers, served, CFG)["p"].effective == 0.0
