"""State that grew without bound, a loop that died on one refused record,
and one prober able to spend a peer's whole probe budget."""

from __future__ import annotations

import asyncio

from p2pserve.client.failover import BanList
from p2pserve.config import DHTConfig, ProberConfig
from p2pserve.dht.announcer import Announcer
from p2pserve.dht.prober import LinkProber
from p2pserve.dht.records import MAX_ADDRS, PeerInfo
from p2pserve.peer.agent import announceable
from p2pserve.testing import FakeClock, FakeSwarm, FakeSwarmStore


def test_bans_are_forgotten_once_long_over():
    clock = FakeClock()
    bans = BanList(5.0, 60.0, clock)
    for i in range(1000):
        bans.ban(f"peer{i}")
    assert len(bans.until) == 1000
    clock.advance(5.0 + 60.0)
    assert bans.active() == frozenset()
    assert not bans.until and not bans.strikes  # a client that runs for months keeps nothing
    assert bans.ban("peer1") == 5.0  # and a peer that behaved that long starts afresh


def test_the_announcer_survives_a_refused_record_and_never_withdraws_on_it():
    store, clock = FakeSwarmStore(), FakeClock()
    swarm = FakeSwarm(store, "p", DHTConfig(model="m", peer_refresh=1.0))
    addrs = [f"/ip4/10.0.0.{i}/tcp/4000/p2p/p" for i in range(40)]  # a host with many interfaces
    refused = {"n": 0}

    def info():
        if refused["n"] < 2:  # as before the fix: more than MAX_ADDRS addresses
            refused["n"] += 1
            return PeerInfo(model="m", peer_id="p", addrs=addrs)
        return PeerInfo(model="m", peer_id="p", addrs=announceable(addrs))

    ann = Announcer(swarm, info, clock=clock)

    async def go():
        await ann.step()  # raised RecordRejected out of run() before, which then withdrew us
        clock.advance(1.0)
        await ann.step()
        clock.advance(1.0)
        await ann.step()
        return await swarm.get_peers()

    peers = asyncio.run(go())
    assert ann.failures == 2
    assert len(peers["p"].record.addrs) == MAX_ADDRS


def test_one_prober_gets_only_its_share_of_the_probe_budget():
    clock = FakeClock()
    cfg = ProberConfig(server_bytes_per_s=100.0, server_burst_bytes=1000, per_prober_share=0.25)
    prober = LinkProber(None, cfg, clock=clock)
    assert prober._take("greedy", 250)
    assert not prober._take("greedy", 1)  # its share is spent
    assert prober._take("other", 250) and prober._take("third", 250)  # the rest still probe
    clock.advance(10.0)  # 25 bytes/s each refill
    assert prober._take("greedy", 250)


def test_the_plan_expiration_map_holds_only_live_plans():
    from p2pserve.dht.plan_chunks import encode, split_plan
    from p2pserve.dht.plan_store import index_key
    from p2pserve.dht.records import Plan
    from p2pserve.dht.signing import load_or_create_key, owner_subkey
    from p2pserve.dht.swarm import Swarm
    from p2pserve.testing import FakeDHT

    dht, clock = FakeDHT(), FakeClock()
    reader = Swarm(DHTConfig(model="m", swarm_id="s"), dht, load_or_create_key(None), clock=clock)
    key = index_key(reader)
    for epoch in range(20):  # signers come and go (an open swarm: anyone may publish)
        index, _ = split_plan(Plan(model="m", epoch=epoch, leader_id=f"c{epoch}", num_layers=4), {})
        dht.data[key] = {owner_subkey(load_or_create_key(None)): FakeDHT.Entry(encode(index), clock() + 10)}
        asyncio.run(reader.get_plan())
    assert len(reader._plan_expiration) <= 1  # (none of these signers stood for election: none is followed)
