"""Announcer, coordinator loop and prober arithmetic against fakes (no network, fake clock)."""

import asyncio

import pytest

from p2pserve.cli.status import collect_status, format_status
from p2pserve.config import CoordinatorConfig, DHTConfig, ProberConfig
from p2pserve.coordinator.service import CoordinatorService
from p2pserve.dht.announcer import Announcer
from p2pserve.dht.election import choose_plan
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.prober import LinkProber, TokenBucket, bandwidth_from, next_probe_size
from p2pserve.dht.records import LinkInfo, LinkStat, PeerInfo
from p2pserve.testing import FakeClock, FakeSwarm, FakeSwarmStore, MissingReads


def run(coro):
    return asyncio.run(coro)


def test_announcer_refreshes_on_period_and_withdraws():
    store, clock = FakeSwarmStore(), FakeClock()
    sw = FakeSwarm(store, "p", DHTConfig(model="m", peer_refresh=5.0, link_refresh=20.0))
    calls = []

    def info():
        calls.append(clock.t)
        return PeerInfo(model="m", peer_id="p")

    ann = Announcer(sw, info, lambda: LinkInfo(model="m", peer_id="p"), clock=clock)

    async def go():
        assert await ann.step() == 5.0
        clock.advance(2.0)
        assert await ann.step() == 3.0
        clock.advance(3.0)
        await ann.step()
        assert calls == [1000.0, 1005.0]
        assert "p" in await sw.get_peers() and "p" in await sw.get_links()
        await ann.shutdown()
        assert "p" not in await sw.get_peers() and sw.public_key in sw.withdrawn[RecordKind.PEERS]

    run(go())


def test_coordinator_failover_with_fake_clock():
    store, clock = FakeSwarmStore(), FakeClock()
    cfg = DHTConfig(model="m", candidate_refresh=1.0, plan_refresh=2.0, max_clock_skew=0.0)
    sa, sb = FakeSwarm(store, "a", cfg), FakeSwarm(store, "b", cfg)
    a = CoordinatorService(sa, CoordinatorConfig(num_layers=4, priority=2, solve_time_limit=0.2), clock=clock)
    b = CoordinatorService(sb, CoordinatorConfig(num_layers=4, priority=1, solve_time_limit=0.2), clock=clock)
    x = FakeSwarm(store, "x", DHTConfig(model="m"))
    asyncio.run(x.announce_peer(PeerInfo(model="m", peer_id="x", max_layers=4, throughput_decode=[4.0, 3.0, 2.0, 1.0])))

    def plan_of(swarm):
        return store.get(RecordKind.PLAN, swarm.public_key)

    async def go():
        await a.step(), await b.step()  # inside the election grace: nobody leads yet
        assert not a.is_leader and not b.is_leader and not await x.get_plans()
        clock.advance(2.5)
        assert (await a.step()).startswith("published")
        assert await b.step() is None and a.is_leader and not b.is_leader
        assert plan_of(sa).epoch == 1 and plan_of(sa).targets == {"x": (0, 4)}
        # a dies (its candidacy disappears); b takes over with a higher epoch and the same placement
        store.drop(RecordKind.COORDINATORS, sa.public_key)
        assert (await b.step()).startswith("published")
        pb = plan_of(sb)
        assert pb.epoch == 2 and pb.targets == {"x": (0, 4)} and pb.leader_id == "b"
        assert choose_plan(await x.get_plans()).plan.leader_id == "b"
        # nothing changed: only refreshes, same epoch
        clock.advance(2.5)
        assert await b.step() == "refreshed"
        assert plan_of(sb).epoch == 2

    run(go())


def test_a_takeover_does_not_plan_from_one_read_that_missed_a_serving_peer():
    store, clock = FakeSwarmStore(), FakeClock()
    cfg = DHTConfig(model="m", candidate_refresh=1.0, plan_refresh=2.0, peer_refresh=1.0, max_clock_skew=0.0)
    sa, sb = FakeSwarm(store, "a", cfg), MissingReads(store, "b", cfg)
    a = CoordinatorService(sa, CoordinatorConfig(num_layers=4, priority=2, solve_time_limit=0.2), clock=clock)
    b = CoordinatorService(sb, CoordinatorConfig(num_layers=4, priority=1, solve_time_limit=0.2), clock=clock)
    for name, span in (("x", (0, 2)), ("y", (2, 4))):
        asyncio.run(FakeSwarm(store, name, DHTConfig(model="m")).announce_peer(PeerInfo(
            model="m", peer_id=name, max_layers=2, throughput_decode=[4.0, 3.0], serving=span, state="serving")))

    async def go():
        await a.step(), await b.step()
        clock.advance(2.5)
        assert (await a.step()).startswith("published") and await b.step() is None
        assert store.get(RecordKind.PLAN, sa.public_key).max_flow > 0
        # a dies; b's first read as the leader misses y, whose record is alive: y still serves
        store.drop(RecordKind.COORDINATORS, sa.public_key)
        sb.miss = {"y"}
        assert (await b.step()).startswith("published")
        pb = store.get(RecordKind.PLAN, sb.public_key)
        assert pb.leader_id == "b" and set(pb.spans) == {"x", "y"} and pb.max_flow > 0

    run(go())


def test_probe_sizing_covers_slow_and_fast_links():
    cfg = ProberConfig(target_transfer_s=0.1)
    # 10 Mbit/s: 64 KiB takes 52 ms -> one more, bigger transfer lasts past the target
    nxt = next_probe_size(64 << 10, 0.0524, cfg)
    assert nxt is not None and nxt / 1.25e6 >= cfg.target_transfer_s
    assert next_probe_size(nxt, nxt / 1.25e6, cfg) is None
    # 10 Gbit/s: grows until the cap
    n, steps = cfg.min_probe_bytes, 0
    while n is not None and steps < 20:
        elapsed = n / 1.25e9 + 1e-4
        last = n
        n = next_probe_size(n, elapsed, cfg)
        steps += 1
    assert last == cfg.max_probe_bytes or last / 1.25e9 >= cfg.target_transfer_s
    assert bandwidth_from(1_000_000, 0.011, 0.001) == pytest.approx(1e8)
    # an inflated ping cannot inflate the reading by more than 1 / 0.9
    assert bandwidth_from(1000, 0.002, 0.002) == pytest.approx(1000 / 0.0018)
    # a long-RTT link: transfers grow until they last 10 RTTs, not just the target
    assert next_probe_size(1 << 20, 0.5, cfg, rtt=0.1) is not None
    assert next_probe_size(1 << 20, 1.0, cfg, rtt=0.1) is None


def test_token_bucket():
    clock = FakeClock()
    b = TokenBucket(rate=100.0, burst=200.0, clock=clock)
    assert b.take(150) and not b.take(100)
    clock.advance(1.0)
    assert b.take(100)


def test_status_format():
    peers = {"p" * 20: PeerInfo(model="m", peer_id="p" * 20, max_layers=2, throughput_decode=[5.0, 2.5], serving=(0, 2), state="serving")}
    links = [LinkInfo(model="m", peer_id="p" * 20, links={"q": LinkStat(bandwidth=2e6, rtt=0.003)})]
    d = collect_status(peers, links, [], None, now=0.0)
    assert d["peers"][0]["decode_tps"] == 2.5 and d["links"][0]["bandwidth_Bps"] == 2e6 and d["plan"] is None
    text = format_status(d)
    assert "serving" in text and "2.00" in text and "PLAN: none" in text


def test_link_reads_as_its_best_recent_round():
    """A busy host only slows probes down: the estimate is the best of the last rounds."""
    prober = LinkProber(None, ProberConfig(keep_rounds=3))
    for bw, rtt in ((2.4e6, 0.003), (1.3e6, 0.001), (1.7e6, 0.002)):
        prober.record("b", LinkStat(bandwidth=bw, rtt=rtt, measured_at=1.0))
    assert prober.results["b"].bandwidth == 2.4e6 and prober.results["b"].rtt == 0.001
    prober.record("b", LinkStat(bandwidth=1.0e6, rtt=0.004, measured_at=2.0))  # the 2.4 round ages out
    assert prober.results["b"].bandwidth == 1.7e6 and prober.results["b"].measured_at == 2.0
    prober.forget(keep=[])
    assert prober.results == {}
