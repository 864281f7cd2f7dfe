"""No record and no failing tick ends a coordinator (issue 14, finding 3).

A plan record with ``epoch = 2**62`` (allowed by validation, and the default swarm is open) made
every honest coordinator's next epoch fail ``Plan.validate``: ``step()`` raised on every tick,
also after the record expired, and ``run()`` let the exception end the process.
"""

from __future__ import annotations

import asyncio

from p2pserve.config import CoordinatorConfig, DHTConfig
from p2pserve.coordinator.service import CoordinatorService
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.records import MAX_EPOCH, PeerInfo, Plan
from p2pserve.testing import FakeClock, FakeSwarm, FakeSwarmStore

CFG = DHTConfig(model="m", candidate_refresh=1.0, plan_refresh=2.0, max_clock_skew=0.0)  # plans live 4 s


def _swarm():
    store, clock = FakeSwarmStore(), FakeClock()
    sa = FakeSwarm(store, "a", CFG)
    x = FakeSwarm(store, "x", DHTConfig(model="m"))
    asyncio.run(x.announce_peer(PeerInfo(model="m", peer_id="x", max_layers=4, throughput_decode=[4.0, 3.0, 2.0, 1.0])))
    coord = CoordinatorService(sa, CoordinatorConfig(num_layers=4, priority=1, solve_time_limit=0.2, tick=0.01),
                               clock=clock)
    return store, clock, sa, coord


def test_a_plan_at_the_highest_epoch_does_not_break_the_honest_coordinator():
    store, clock, sa, coord = _swarm()
    rogue = Plan(model="m", epoch=MAX_EPOCH, leader_id="rogue", num_layers=4)
    store.put(RecordKind.PLAN, "rogue-key", rogue, ttl=5.0)

    async def go():
        clock.advance(2.5)
        assert (await coord.step()).startswith("published")
        mine = store.get(RecordKind.PLAN, sa.public_key)
        mine.validate()
        assert mine.epoch == MAX_EPOCH and mine.targets == {"x": (0, 4)}
        # the rogue record expires; the coordinator goes on refreshing a valid plan
        clock.advance(6.0)
        for _ in range(3):
            await coord.step()  # raised on every tick before, also after the record expired
            clock.advance(1.0)
        store.get(RecordKind.PLAN, sa.public_key).validate()

    asyncio.run(go())


def test_a_tick_that_raises_is_logged_and_the_loop_goes_on(caplog):
    store, clock, sa, coord = _swarm()
    real = sa.get_peers
    calls = {"n": 0}

    async def flaky():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug in one tick")
        return await real()

    sa.get_peers = flaky
    clock.advance(2.5)

    async def go():
        stop = asyncio.Event()
        task = asyncio.create_task(coord.run(stop))
        for _ in range(300):
            await asyncio.sleep(0.01)
            if store.get(RecordKind.PLAN, sa.public_key) is not None:
                break
        stop.set()
        await task

    asyncio.run(go())
    assert calls["n"] >= 2, "the loop stopped after the failing tick"
    assert store.get(RecordKind.PLAN, sa.public_key) is not None
    assert "a bug in one tick" in caplog.text
