"""The client side of claims: a pipeline times its decode hops, the observer turns them into a
valid ``ServiceReports`` record, and the publisher announces it (fake peers, fake swarm)."""

from __future__ import annotations

import asyncio

import pytest

from p2pserve.client.hop import Hop
from p2pserve.client.trust.observer import ReportPublisher, ServiceObserver
from p2pserve.client.pipeline import Pipeline
from p2pserve.config import DHTConfig
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.reports import ServiceReports
from p2pserve.testing import FakeClock, FakePeerNetwork, FakeSwarm, FakeSwarmStore, FixedRoutes


def test_decode_hops_are_observed_and_prefill_is_not():
    net = FakePeerNetwork(num_layers=8)
    net.add("a", 0, 3)
    net.add("b", 3, 8)
    obs = ServiceObserver(window=16)

    async def go():
        p = Pipeline(net.client(), FixedRoutes([Hop("a", 0, 3), Hop("b", 3, 8)]), "fake-model", 8, max_length=64,
                     observer=obs)
        async with p:
            token = await p.step([1, 2, 3, 4])  # prefill: not a decode sample
            for _ in range(5):
                token = await p.step([token])

    asyncio.run(go())
    rates = {r.peer_id: r for r in obs.rates()}
    assert set(rates) == {"a", "b"}
    assert rates["a"].layers == 3 and rates["b"].layers == 5 and rates["a"].samples == 5
    assert rates["a"].rate >= rates["a"].wall_rate > 0
    rep = obs.report("client", "m", [])
    rep.validate()


def test_rates_take_the_rtt_out_and_forget_old_peers():
    clock = FakeClock(100.0)
    obs = ServiceObserver(window=4, max_age_s=60.0, clock=clock)
    obs.rtt("p", 2, 0.010)
    obs.rtt("p", 2, 0.008)  # the smallest RTT counts
    for rt in (0.020, 0.018, 0.5, 0.018):  # one stall: the median ignores it
        obs.decode("p", 2, rt)
    (r,) = obs.rates()
    assert r.samples == 4 and r.wall_rate == pytest.approx(1 / 0.019) and r.rate == pytest.approx(1 / 0.011)
    obs.decode("p", 3, 0.02)  # a new span: a new window
    assert obs.rates()[0].layers == 3 and obs.rates()[0].samples == 1
    clock.advance(61.0)
    assert obs.rates() == [] and obs.report("me", "m", []) is None


def test_the_publisher_announces_a_record_the_coordinator_can_read():
    store = FakeSwarmStore()
    cfg = DHTConfig(model="m")
    client = FakeSwarm(store, "client", cfg)
    obs = ServiceObserver()
    pub = ReportPublisher(client, obs, period=30.0)
    assert asyncio.run(pub.publish()) is False  # nothing observed: nothing announced
    obs.decode("peer", 4, 0.01)
    assert asyncio.run(pub.publish()) is True
    (signed,) = asyncio.run(FakeSwarm(store, "coord", cfg).read(RecordKind.REPORTS, ServiceReports))
    assert signed.record.reporter_id == "client" and signed.record.rates[0].peer_id == "peer"
