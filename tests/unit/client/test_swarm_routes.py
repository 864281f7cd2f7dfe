"""SwarmRoutes with a fake Swarm: plan flows, departed peers, KV masking, no-plan fallback, caching."""

from __future__ import annotations

import asyncio

import pytest

from p2pserve.client.routing import Masks, NoRouteError
from p2pserve.client.swarm_routes import SwarmRoutes, graph_from_records
from p2pserve.config import DHTConfig
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.records import Flow, PeerInfo, Plan
from p2pserve.errors import RoutingError
from p2pserve.testing import FakeClock, FakeSwarm, FakeSwarmStore

M = "m"


def info(pid, span, kv_free=1000, kv_bytes=1 << 20, state="serving", loading=None):
    return PeerInfo(model=M, peer_id=pid, addrs=[f"/ip4/127.0.0.1/tcp/1/p2p/{pid}"], serving=span, state=state,
                    loading=loading, kv_free_tokens=kv_free, kv_memory_bytes=kv_bytes)


PLAN = Plan(model=M, epoch=3, leader_id="c", num_layers=8, spans={"A": (0, 4), "B": (0, 4), "C": (4, 8)},
            flows=[Flow("source", "A", 10.0), Flow("source", "B", 10.0), Flow("A", "C", 10.0), Flow("B", "C", 10.0),
                   Flow("C", "sink", 20.0)])


def fake_swarm(plan, peers):
    """A client's view of a swarm whose leader published ``plan`` and whose ``peers`` announced."""
    store = FakeSwarmStore()
    for p in peers:
        store.put(RecordKind.PEERS, p.peer_id, p)
    if plan is not None:
        store.put(RecordKind.PLAN, "c", plan)
    return FakeSwarm(store, "client", DHTConfig(model=M))


def reads(swarm):
    return swarm.calls["get_plan"]


def test_graph_drops_departed_peers_and_their_flows():
    g = graph_from_records(PLAN, {"A": info("A", (0, 4)), "C": info("C", (4, 8))}, 8)
    assert set(g.spans) == {"A", "C"}
    assert ("source", "B") not in g.flows and ("A", "C") in g.flows
    assert g.maddrs["A"] == ("/ip4/127.0.0.1/tcp/1/p2p/A",)


def test_peer_that_moved_range_is_dropped():
    g = graph_from_records(PLAN, {"A": info("A", (4, 8)), "B": info("B", (0, 6)), "C": info("C", (4, 8))}, 8)
    assert set(g.spans) == {"B", "C"}


def test_without_a_plan_routes_over_serving_spans():
    peers = {"A": info("A", (0, 4)), "C": info("C", (4, 8)), "L": info("L", None, state="joining")}
    g = graph_from_records(None, peers, 8)
    assert set(g.spans) == {"A", "C"} and not g.flows
    assert graph_from_records(None, peers, None) is None


def test_routes_follow_plan_mask_kv_and_cache_reads():
    clock = FakeClock(0.0)
    swarm = fake_swarm(PLAN, [info("A", (0, 4), kv_free=10), info("B", (0, 4)), info("C", (4, 8))])
    routes = SwarmRoutes(swarm, seed=0, num_layers=8, refresh_s=5.0, clock=clock)
    hops = asyncio.run(routes.route(Masks(), kv_need_tokens=100))  # A is over the high-water mark
    assert [(h.peer_id, h.start, h.end) for h in hops] == [("B", 0, 4), ("C", 4, 8)]
    assert asyncio.run(routes.route(Masks(), kv_need_tokens=5))  # small requests may use A
    assert reads(swarm) == 1  # cached within refresh_s
    clock.advance(10.0)
    asyncio.run(routes.route(Masks()))
    assert reads(swarm) == 2 and routes.epoch == 3
    with pytest.raises(NoRouteError) as e:
        asyncio.run(routes.route(Masks(banned=frozenset({"C"}))))
    assert "layer 4" in str(e.value)


def test_peer_without_kv_budget_is_not_kv_masked():
    swarm = fake_swarm(PLAN, [info("A", (0, 4), kv_free=0, kv_bytes=0), info("C", (4, 8))])
    routes = SwarmRoutes(swarm, seed=0, num_layers=8)
    assert [h.peer_id for h in asyncio.run(routes.route(Masks(), kv_need_tokens=100))] == ["A", "C"]


def test_no_plan_and_no_peers_is_a_routing_error():
    routes = SwarmRoutes(fake_swarm(None, []), seed=0, num_layers=None)
    with pytest.raises(RoutingError):
        asyncio.run(routes.route(Masks()))


def test_stale_plan_falls_back_to_announced_ranges_and_invalidate_rereads():
    """C flipped from [4, 8) to [5, 8) after the plan: no plan route is left, the served ranges have one."""
    swarm = fake_swarm(PLAN, [info("A", (0, 4)), info("B", (0, 5)), info("C", (5, 8))])
    routes = SwarmRoutes(swarm, seed=0, num_layers=8, refresh_s=60.0, clock=FakeClock(0.0))
    hops = asyncio.run(routes.route(Masks()))
    assert [(h.peer_id, h.start, h.end) for h in hops] == [("B", 0, 5), ("C", 5, 8)]
    provider = routes.for_request(16)
    asyncio.run(provider.route(Masks()))
    assert reads(swarm) == 1  # cached
    provider.invalidate()
    asyncio.run(provider.route(Masks()))
    assert reads(swarm) == 2


def test_a_read_that_misses_peers_keeps_them_until_their_records_expire():
    """One DHT read can come back empty (seen under chaos): the view keeps what it saw until
    each record's own expiration, and drops a peer that withdrew at once."""
    wall = FakeClock(100.0)
    store = FakeSwarmStore(clock=wall)
    for p in (info("A", (0, 4)), info("B", (0, 4)), info("C", (4, 8))):
        store.put(RecordKind.PEERS, p.peer_id, p, ttl=10.0)
    store.put(RecordKind.PLAN, "c", PLAN, ttl=10.0)
    swarm = FakeSwarm(store, "client", DHTConfig(model=M))
    routes = SwarmRoutes(swarm, seed=0, num_layers=8, refresh_s=0.0, clock=FakeClock(0.0), wall_clock=wall)
    asyncio.run(routes.route(Masks()))
    for pid in ("A", "B", "C"):
        store.drop(RecordKind.PEERS, pid)  # this read finds nothing
    hops = asyncio.run(routes.route(Masks(banned=frozenset({"A"}))))
    assert [h.peer_id for h in hops] == ["B", "C"]
    wall.advance(11.0)  # now their records have expired: they are gone
    with pytest.raises(RoutingError):
        asyncio.run(routes.route(Masks()))


def test_a_withdrawn_peer_leaves_the_view_at_once():
    swarm = fake_swarm(PLAN, [info("A", (0, 4)), info("B", (0, 4)), info("C", (4, 8))])
    routes = SwarmRoutes(swarm, seed=0, num_layers=8, refresh_s=0.0, clock=FakeClock(0.0))
    asyncio.run(routes.route(Masks()))
    swarm.store.withdraw(RecordKind.PEERS, "A")
    assert all(h.peer_id != "A" for _ in range(4) for h in asyncio.run(routes.route(Masks())))


def test_a_failed_read_keeps_the_last_view():
    swarm = fake_swarm(PLAN, [info("A", (0, 4)), info("C", (4, 8))])
    routes = SwarmRoutes(swarm, seed=0, num_layers=8, refresh_s=0.0, clock=FakeClock(0.0))
    asyncio.run(routes.route(Masks()))

    async def fail():
        raise TimeoutError

    swarm.get_peers = fail
    assert [h.peer_id for h in asyncio.run(routes.route(Masks()))] == ["A", "C"]


def test_a_peer_loading_its_next_range_still_serves_the_current_one():
    """The plan's route needs B, which is gone; A is moving (state "loading") but still serves
    [0, 4): the fallback over served ranges must use it."""
    peers = [info("A", (0, 4), state="loading", loading=(0, 6)), info("C", (4, 8))]
    plan = Plan(model=M, epoch=3, leader_id="c", num_layers=8, spans={"B": (0, 4), "C": (4, 8)},
                flows=[Flow("source", "B", 10.0), Flow("B", "C", 10.0), Flow("C", "sink", 10.0)])
    routes = SwarmRoutes(fake_swarm(plan, peers), seed=0, num_layers=8)
    assert [h.peer_id for h in asyncio.run(routes.route(Masks()))] == ["A", "C"]


def test_a_range_that_moved_within_one_epoch_rebuilds_the_routes():
    """C flips from [4, 8) to [6, 8) and B from [0, 4) to [0, 6) while the epoch stays (no
    leader re-planned yet): the next read must not keep routing over the old ranges."""
    swarm = fake_swarm(PLAN, [info("B", (0, 4)), info("C", (4, 8))])
    routes = SwarmRoutes(swarm, seed=0, num_layers=8, refresh_s=0.0, clock=FakeClock(0.0))
    assert [(h.peer_id, h.start) for h in asyncio.run(routes.route(Masks()))] == [("B", 0), ("C", 4)]
    swarm.store.put(RecordKind.PEERS, "B", info("B", (0, 6)))
    swarm.store.put(RecordKind.PEERS, "C", info("C", (6, 8)))
    assert [(h.peer_id, h.start, h.end) for h in asyncio.run(routes.route(Masks()))] == [("B", 0, 6), ("C", 6, 8)]
