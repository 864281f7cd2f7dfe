"""A chunked plan over real DHT nodes: many signed identities on one node, a trusted coordinator
publishing an index and chunks, a client reading one region's route, an untrusted forger ignored.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from p2pserve.config import DHTConfig
from p2pserve.dht.multi_identity import identity_swarms
from p2pserve.dht.plan_chunks import delta, split_plan
from p2pserve.dht.plan_store import publish_chunked
from p2pserve.dht.records import Flow, Plan
from p2pserve.dht.signing import load_or_create_key, public_key_text
from p2pserve.dht.swarm import Swarm
from p2pserve.types import SINK, SOURCE

pytestmark = pytest.mark.integration

MODEL = "tiny-8"


def two_region_plan(ids: list[str], epoch: int) -> tuple[Plan, dict[str, str]]:
    """Peers in pairs: [0, 4) then [4, 8); pairs 0-1 in region a, 2-3 in region b."""
    targets, flows, groups = {}, [], {}
    for x in range(0, len(ids), 2):
        a, b = ids[x], ids[x + 1]
        targets[a], targets[b] = (0, 4), (4, 8)
        flows += [Flow(SOURCE, a, 5.0), Flow(a, b, 5.0), Flow(b, SINK, 5.0)]
        groups[a] = groups[b] = "a" if x < len(ids) // 2 else "b"
    return Plan(model=MODEL, epoch=epoch, leader_id="lead", num_layers=8, targets=targets, spans=dict(targets),
                flows=flows, created_at=1.0), groups


def test_chunked_plan_round_trip_over_the_dht():
    asyncio.run(_round_trip())


async def _round_trip():
    keys = [load_or_create_key(None) for _ in range(5)]
    coordinator_key = load_or_create_key(None)
    base = DHTConfig(model=MODEL, num_layers=8, host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                     trusted_coordinators=(public_key_text(coordinator_key),))
    swarms = identity_swarms(base, keys)  # one node stores for five identities
    joined = replace(base, initial_peers=tuple(swarms[0].visible_maddrs()))
    coord = Swarm(joined, Swarm.start_dht(joined, coordinator_key), coordinator_key)
    client = Swarm.create(joined)
    try:
        ids = [s.peer_id for s in swarms[1:]]
        plan, groups = two_region_plan(ids, 1)
        index, chunks = split_plan(plan, groups)
        index, fresh = delta(None, index, chunks)
        assert await publish_chunked(coord, index, fresh)
        # an identity that is no trusted coordinator publishes a higher epoch: ignored
        forged, _ = split_plan(Plan(model=MODEL, epoch=9, leader_id="x", num_layers=8), {})
        assert await publish_chunked(swarms[1], forged, [])
        [(followed, _)] = await client.read_plans()
        assert followed.plan.epoch == 1 and followed.signer == public_key_text(coordinator_key)
        assert followed.plan.targets == plan.targets and followed.plan.flows == plan.flows  # every chunk
        route = await read_route_plan(client, "b")
        assert set(route.spans) == set(ids[2:])  # one region read, the other not
        assert all(f.src in (SOURCE, *route.spans) for f in route.flows)
        # the coordinator's own path: Swarm.publish_plan chunks by the flow's parts, get_plan assembles
        assert (await client.get_plan()).plan.targets == plan.targets
        # epoch 2 moves one peer of region b: only b's chunk is stored again
        moved = dict(plan.targets)
        moved[ids[3]] = (5, 8)
        plan2 = replace_plan(plan, 2, moved)
        index2, chunks2 = split_plan(plan2, groups)
        index2, fresh2 = delta(index, index2, chunks2)
        assert [c.name for c in fresh2] == ["b"]
        assert await publish_chunked(coord, index2, fresh2)
        assert (await read_route_plan(client, "a")).spans == {i: plan.targets[i] for i in ids[:2]}  # old chunk
        assert (await read_route_plan(client, "b")).targets[ids[3]] == (5, 8)
    finally:
        for node in (client, coord, swarms[0]):
            node.shutdown()


async def read_route_plan(client: Swarm, group: str) -> Plan:
    """The followed plan with only ``group``'s chunks read."""
    [(followed, _)] = await client.read_plans(group)
    return followed.plan


def replace_plan(plan: Plan, epoch: int, targets: dict) -> Plan:
    import msgspec

    return msgspec.structs.replace(plan, epoch=epoch, targets=targets, spans=dict(targets))
