"""No record and no failing tick ends a coordinator.

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
from p2pserve.dht.election import epoch_ceiling
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
        # the honest epoch stops at what time allows; readers drop the rogue's, which is beyond it
        assert mine.epoch == epoch_ceiling(clock()) < MAX_EPOCH and mine.targets == {"x": (0, 4)}
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


def _flooded(n_liars: int, num_layers: int = 30):
    """Two honest peers and ``n_liars`` peers claiming the most throughput records allow."""
    from p2pserve.dht.records import MAX_TOKENS_PER_S

    store, clock = FakeSwarmStore(), FakeClock()
    sa = FakeSwarm(store, "a", CFG)
    for i in range(2):
        h = FakeSwarm(store, f"honest{i}", DHTConfig(model="m"))
        asyncio.run(h.announce_peer(PeerInfo(model="m", peer_id=f"honest{i}", max_layers=num_layers,
                                             throughput_decode=[50.0 / j for j in range(1, num_layers + 1)])))
    for i in range(n_liars):
        liar = FakeSwarm(store, f"liar{i}", DHTConfig(model="m"))
        asyncio.run(liar.announce_peer(PeerInfo(model="m", peer_id=f"liar{i}", max_layers=num_layers,
                                                throughput_decode=[MAX_TOKENS_PER_S] * num_layers)))
    coord = CoordinatorService(sa, CoordinatorConfig(num_layers=num_layers, priority=1, solve_time_limit=1.0,
                                                     tick=0.01), clock=clock)
    return store, clock, sa, coord


def test_a_flood_of_maximal_claims_still_yields_a_valid_plan():
    """20 records claiming 1e8 tok/s pushed the plan's upper bound past its own validity limit,
    so the honest coordinator built a plan it then refused to publish, on every tick."""
    store, clock, sa, coord = _flooded(20)

    async def go():
        clock.advance(2.5)
        return await coord.step()

    assert asyncio.run(go()).startswith("published")
    plan = store.get(RecordKind.PLAN, sa.public_key)
    plan.validate()
    assert set(plan.targets) >= {"honest0", "honest1"}


def test_a_peer_record_is_checked_against_the_model_when_read(caplog):
    """A reader that knows the model's layer count rejects records beyond it (``max_layers=4096``
    and a 4000-layer span passed for a 4-layer model)."""
    from p2pserve.dht.keys import record_key
    from p2pserve.dht.records import encode_record
    from p2pserve.dht.identity import peer_id_of
    from p2pserve.dht.signing import load_or_create_key, owner_subkey, public_key_text
    from p2pserve.dht.swarm import Swarm
    from p2pserve.testing import FakeDHT

    dht, clock = FakeDHT(), FakeClock()
    cfg = DHTConfig(model="m", swarm_id="s", num_layers=4, reject_log_interval=0.0)
    reader = Swarm(cfg, dht, load_or_create_key(None), clock=clock)
    key = record_key("s", "m", RecordKind.PEERS)
    liar, ok = load_or_create_key(None), load_or_create_key(None)
    ok_id = peer_id_of(public_key_text(ok))
    for signer, info in ((liar, PeerInfo(model="m", peer_id=peer_id_of(public_key_text(liar)), max_layers=4096,
                                         serving=(0, 4000))),
                         (ok, PeerInfo(model="m", peer_id=ok_id, max_layers=4, serving=(0, 4)))):
        dht.data.setdefault(key, {})[owner_subkey(signer)] = FakeDHT.Entry(encode_record(info), clock() + 5.0)
    peers = asyncio.run(reader.get_peers())
    assert set(peers) == {ok_id}
    assert "max_layers=4096" in caplog.text
