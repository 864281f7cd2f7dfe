"""A peer's probing rounds (``dht/probe_rounds.py``) over an in-memory swarm and prober."""

from __future__ import annotations

import asyncio

from p2pserve.config import DHTConfig
from p2pserve.dht.probe_rounds import ProbeRounds
from p2pserve.dht.records import PeerInfo
from p2pserve.testing import FakeClock, FakeLinkProbes, FakeSwarm, FakeSwarmStore, MissingReads

CFG = DHTConfig(model="m", peer_refresh=1.0, max_clock_skew=0.0)


def announce(store: FakeSwarmStore, name: str) -> FakeSwarm:
    node = FakeSwarm(store, name, CFG)
    asyncio.run(node.announce_peer(PeerInfo(model="m", peer_id=name, max_layers=2, throughput_decode=[4.0, 3.0],
                                            addrs=[f"/ip4/127.0.0.1/tcp/{1000 + len(name)}"])))
    return node


def test_a_read_that_misses_a_live_peer_keeps_its_link_and_does_not_probe_it_again():
    clock = FakeClock()
    store = FakeSwarmStore(clock)
    me = MissingReads(store, "me", CFG)
    for name in ("x", "yy"):
        announce(store, name)
    prober = FakeLinkProbes()
    rounds = ProbeRounds(me, prober, wall=clock)
    assert set(asyncio.run(rounds.step())) == {"x", "yy"}
    me.miss = {"yy"}  # its record is alive (TTL 2 s); this read just did not find it
    clock.advance(0.5)
    assert asyncio.run(rounds.step()) == {}
    assert set(prober.results) == {"x", "yy"} and prober.probed == ["x", "yy"]


def test_a_peer_whose_record_expired_or_was_withdrawn_is_forgotten():
    clock = FakeClock()
    store = FakeSwarmStore(clock)
    me = MissingReads(store, "me", CFG)
    announce(store, "x")
    gone = announce(store, "yy")
    prober = FakeLinkProbes()
    rounds = ProbeRounds(me, prober, wall=clock)
    asyncio.run(rounds.step())
    asyncio.run(gone.withdraw_all())
    asyncio.run(rounds.step())
    assert set(prober.results) == {"x"}
    clock.advance(CFG.peer_ttl + 1)  # x's record expires; nothing read it since
    asyncio.run(rounds.step())
    assert prober.results == {}
