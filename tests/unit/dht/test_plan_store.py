"""Swarm.publish_plan / get_plan as an index and chunks on a fake DHT: a plan of hundreds of
peers round-trips with every value within the safe size, deltas store only what changed, and a
chunk or an index from anyone but the followed signer is not followed."""

import asyncio

import msgspec
import pytest

from p2pserve.config import DHTConfig
from p2pserve.dht.plan_chunks import CHUNK_LIMIT_BYTES, decode_index, flow_groups
from p2pserve.dht.plan_store import chunk_key, index_key
from p2pserve.dht.records import CoordinatorCandidate, Flow, Plan, encode_record
from p2pserve.dht.signing import load_or_create_key, owner_subkey, public_key_text
from p2pserve.dht.swarm import Swarm
from p2pserve.testing import FakeClock, FakeDHT
from p2pserve.types import SINK, SOURCE


@pytest.fixture(scope="module")
def keys():
    return [load_or_create_key(None) for _ in range(3)]


def make(keys, i, dht, clock, trusted=()):
    cfg = DHTConfig(model="m", swarm_id="s", num_layers=8, plan_refresh=5.0, max_clock_skew=0.0,
                    trusted_coordinators=tuple(public_key_text(keys[j]) for j in trusted), reject_log_interval=0.0)
    return Swarm(cfg, dht, keys[i], clock=clock)


def big_plan(n: int, epoch: int, leader: str = "lead") -> Plan:
    """``n`` peers in pipelines of two ([0, 4) then [4, 8)), each pipeline its own flow part."""
    ids = [f"peer-{x:05d}-" + "x" * 40 for x in range(n)]
    targets, flows = {}, []
    for x in range(0, n, 2):
        a, b = ids[x], ids[x + 1]
        targets[a], targets[b] = (0, 4), (4, 8)
        flows += [Flow(SOURCE, a, 5.0), Flow(a, b, 5.0), Flow(b, SINK, 5.0)]
    return Plan(model="m", epoch=epoch, leader_id=leader, num_layers=8, targets=targets, spans=dict(targets),
                flows=flows, created_at=1.0, groupings={"machine-1": [2, 1, 1]})


def test_a_large_plan_round_trips_in_values_that_fit(keys):
    dht, clock = FakeDHT(), FakeClock()
    coord, reader = make(keys, 0, dht, clock, trusted=(0,)), make(keys, 1, dht, clock, trusted=(0,))
    plan = big_plan(400, 3)
    assert len(encode_record(plan)) > 2 * CHUNK_LIMIT_BYTES  # one record would not fit

    async def go():
        assert await coord.publish_plan(plan)
        assert all(len(e.value) <= CHUNK_LIMIT_BYTES for entries in dht.data.values() for e in entries.values())
        got = (await reader.get_plan()).plan
        assert (got.targets, got.spans, got.groupings) == (plan.targets, plan.spans, plan.groupings)
        assert sorted(got.flows, key=lambda f: (f.src, f.dst)) == sorted(plan.flows, key=lambda f: (f.src, f.dst))
        # one route's group only: a whole pipeline, not the swarm
        [(part, _)] = await reader.read_plans("")
        assert 0 < len(part.plan.spans) < len(plan.spans)
        assert all(f.src == SOURCE or f.src in part.plan.spans for f in part.plan.flows)

    asyncio.run(go())


def test_a_new_epoch_stores_only_the_chunks_that_changed(keys):
    dht, clock = FakeDHT(), FakeClock()
    coord, reader = make(keys, 0, dht, clock, trusted=(0,)), make(keys, 1, dht, clock, trusted=(0,))
    plan = big_plan(400, 3)

    async def go():
        await coord.publish_plan(plan)
        before = set(dht.data)
        first = min(plan.targets)
        moved = msgspec.structs.replace(plan, epoch=4, targets={**plan.targets, first: (0, 3)})
        clock.advance(1.0)
        await coord.publish_plan(moved)
        added = set(dht.data) - before - {index_key(coord)}
        assert len(added) == 1  # the one chunk holding the moved peer
        assert (await reader.get_plan()).plan.targets[first] == (0, 3)
        # chunks an index still names are stored again once a refresh period passed
        clock.advance(6.0)
        await coord.publish_plan(moved)
        index = decode_index(next(iter(dht.data[index_key(coord)].values())).value)
        assert all(dht.data[chunk_key(coord, r.name, r.epoch)][owner_subkey(keys[0])].expiration_time > 1006
                   for r in index.chunks)

    asyncio.run(go())


def test_chunks_and_indexes_from_others_are_not_followed(keys):
    dht, clock = FakeDHT(), FakeClock()
    coord, rogue = make(keys, 0, dht, clock, trusted=(0,)), make(keys, 1, dht, clock, trusted=(0,))
    reader = make(keys, 2, dht, clock, trusted=(0,))
    plan = big_plan(40, 3)

    async def go():
        await coord.publish_plan(plan)
        await rogue.publish_plan(big_plan(40, 9))  # an untrusted index: ignored
        assert (await reader.get_plan()).plan.epoch == 3
        # a chunk stored by someone else under the followed index's key: not used; the index
        # then misses a chunk, and the plan is not followed (the last one stays)
        index = decode_index(dht.data[index_key(coord)][owner_subkey(keys[0])].value)
        ref = index.chunks[0]
        entries = dht.data[chunk_key(coord, ref.name, ref.epoch)]
        honest = entries.pop(owner_subkey(keys[0]))
        entries[owner_subkey(keys[1])] = honest
        fresh = make(keys, 2, dht, clock, trusted=(0,))
        assert await fresh.get_plans() == []
        # tampered content under the right signer: the digest does not match
        entries.pop(owner_subkey(keys[1]))
        entries[owner_subkey(keys[0])] = FakeDHT.Entry(honest.value[:-1] + b"\x01", honest.expiration_time)
        assert await fresh.get_plans() == []
        assert (await reader.get_plan()).plan.epoch == 3  # keeps the last plan it followed

    asyncio.run(go())


def test_an_open_swarm_follows_only_the_elected_candidates_index(keys):
    dht, clock = FakeDHT(), FakeClock()
    lead, other, reader = make(keys, 0, dht, clock), make(keys, 1, dht, clock), make(keys, 2, dht, clock)

    async def go():
        await lead.announce_candidate(CoordinatorCandidate(model="m", coordinator_id="lead", priority=1,
                                                           start_time=1.0, public_key=lead.public_key))
        await other.announce_candidate(CoordinatorCandidate(model="m", coordinator_id="other", start_time=1.0,
                                                            public_key=other.public_key))
        await other.publish_plan(big_plan(40, 50, "other"))
        await other.publish_plan(big_plan(40, 51, "lead"))  # the leader's id, another key
        assert await reader.get_plans() == []
        await lead.publish_plan(big_plan(40, 2, "lead"))
        assert [p.plan.epoch for p in await reader.get_plans()] == [2]

    asyncio.run(go())


def test_flow_groups_hold_whole_pipelines():
    plan = big_plan(6, 1)
    groups = flow_groups(plan)
    ids = sorted(plan.targets)
    assert groups[ids[0]] == groups[ids[1]] != groups[ids[2]]
    assert len(set(groups.values())) == 3
