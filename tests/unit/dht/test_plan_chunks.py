"""A plan as bounded DHT records: chunks per group, deltas between epochs, a client's route."""

from __future__ import annotations

import msgspec
import pytest

from p2pserve.dht.plan_chunks import (
    CHUNK_LIMIT_BYTES, PlanChunk, assemble, decode_chunk, decode_index, delta, encode, route_chunks, split_plan,
)
from p2pserve.dht.records import Flow, Plan, encode_record
from p2pserve.errors import MalformedFrameError, RecordRejected
from p2pserve.types import SINK, SOURCE


def pid(group: int, x: int) -> str:
    return f"12D3KooW{group:04d}{x:040d}"


def region_plan(groups: int, per_group: int, epoch: int = 1, rate: float = 10.0) -> tuple[Plan, dict[str, str]]:
    """Each group: two-stage pipelines (peer 2k holds [0, 40), 2k+1 holds [40, 80))."""
    targets, flows, group_of = {}, [], {}
    for g in range(groups):
        for x in range(per_group):
            p = pid(g, x)
            group_of[p] = f"r{g}"
            targets[p] = (0, 40) if x % 2 == 0 else (40, 80)
            if x % 2 == 0:
                q = pid(g, x + 1)
                flows += [Flow(SOURCE, p, rate), Flow(p, q, rate), Flow(q, SINK, rate)]
    plan = Plan(model="m", epoch=epoch, leader_id="lead", num_layers=80, targets=targets, spans=dict(targets),
                flows=flows, max_flow=rate * groups * per_group / 2, created_at=1.0)
    return plan, group_of


def test_a_thousand_peer_plan_fits_in_chunks_and_reassembles():
    plan, group_of = region_plan(5, 200)
    limit = 8 << 10
    index, chunks = split_plan(plan, group_of, limit=limit)
    assert len(encode_record(plan)) > CHUNK_LIMIT_BYTES  # one record would pass the chunk limit
    assert all(len(encode(c)) <= limit for c in chunks)
    assert len(chunks) > 5  # regions were cut into parts
    decoded = {c.name: decode_chunk(encode(c)) for c in chunks}
    back = assemble(decode_index(encode(index)), decoded)
    assert back.targets == plan.targets and back.spans == plan.spans
    assert sorted((f.src, f.dst, f.rate) for f in back.flows) == sorted((f.src, f.dst, f.rate) for f in plan.flows)


def test_a_delta_republishes_only_changed_chunks():
    plan, group_of = region_plan(5, 20)
    index, chunks = split_plan(plan, group_of)
    index, fresh = delta(None, index, chunks)
    assert len(fresh) == len(chunks)
    moved = dict(plan.targets)
    moved[pid(3, 1)] = (41, 80)  # one peer of region 3 moves
    plan2 = msgspec.structs.replace(plan, epoch=2, targets=moved)
    index2, chunks2 = split_plan(plan2, group_of)
    index2, fresh2 = delta(index, index2, chunks2)
    assert [c.name for c in fresh2] == ["r3"]
    assert {r.name: r.epoch for r in index2.chunks} == {"r0": 1, "r1": 1, "r2": 1, "r3": 2, "r4": 1}
    # a reader holding the old chunks plus the one fresh chunk rebuilds the new plan
    have = {c.name: c for c in chunks}
    have.update({c.name: c for c in fresh2})
    assert assemble(index2, have).targets == moved


def test_a_client_reads_one_group_for_its_route():
    plan, group_of = region_plan(3, 10)
    plan = msgspec.structs.replace(plan, flows=plan.flows + [Flow(SOURCE, pid(1, 0), 50.0)])
    index, chunks = split_plan(plan, group_of)
    assert route_chunks(index) == ["r1"]  # the group taking the most client flow
    assert route_chunks(index, "r2") == ["r2"]
    part = assemble(index, {c.name: c for c in chunks if c.name == "r2"})
    assert set(part.spans) == {pid(2, x) for x in range(10)}
    assert all(f.src in (SOURCE, *part.spans) for f in part.flows)


def test_a_chunk_that_does_not_match_its_index_is_rejected():
    plan, group_of = region_plan(2, 4)
    index, chunks = split_plan(plan, group_of)
    forged = msgspec.structs.replace(chunks[0], targets={**chunks[0].targets, pid(0, 0): (0, 80)})
    with pytest.raises(RecordRejected):
        assemble(index, {forged.name: forged, chunks[1].name: chunks[1]})


@pytest.mark.parametrize("bad", [
    dict(spans={"a": (5, 3)}),
    dict(spans={"a": (0, 81)}),
    dict(spans={"a": (0, 4)}, flows=[Flow("b", SINK, 1.0)]),  # a flow leaving a peer of another chunk
    dict(spans={"a": (0, 4)}, flows=[Flow(SOURCE, "a", float("nan"))]),
    dict(name=""),
    dict(epoch=-1),
])
def test_hostile_chunks_are_rejected_with_a_reason(bad):
    fields = dict(model="m", epoch=1, name="r0", num_layers=80)
    fields.update(bad)
    with pytest.raises(RecordRejected):
        decode_chunk(encode(PlanChunk(**fields)))


def test_garbage_and_oversized_bytes_are_rejected():
    with pytest.raises(MalformedFrameError):
        decode_chunk(b"\xc1garbage")
    with pytest.raises(MalformedFrameError):
        decode_chunk(b"\x00" * (CHUNK_LIMIT_BYTES + 1))
    with pytest.raises(MalformedFrameError):
        decode_index(msgspec.msgpack.encode({"model": 3}))
