"""DHT records: ``decode_record`` for each of the four kinds, and the Plan as its readers use it.

Property: untrusted bytes decode into a record that passes its own validation, or raise
``MalformedFrameError`` / ``RecordRejected`` (both ``ProtocolError``). A record that decodes
keeps its promises: layer ranges non-empty and inside the model (or ``MAX_LAYERS``), figures
finite and bounded, lists bounded; a Plan's flows name only its peers, its coverage has one
entry per layer, and a coordinator can re-publish it under any valid epoch.
"""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import example, given

from p2pserve.client.routing import RouteGraph
from p2pserve.coordinator.plan_record import plan_changed, with_epoch
from p2pserve.dht.machine_info import MAX_MACHINE_GPUS, MachineInfo
from p2pserve.dht.records import (
    MAX_ADDRS,
    MAX_EPOCH,
    MAX_LAYERS,
    MAX_LINKS,
    MAX_RECORD_BYTES,
    MAX_STR,
    CoordinatorCandidate,
    LinkInfo,
    PeerInfo,
    Plan,
    decode_record,
    encode_record,
)
from p2pserve.errors import MalformedFrameError, ProtocolError
from p2pserve.types import SINK, SOURCE
from tests.fuzz import FUZZ, counted
from tests.fuzz.messages import RECORDS
from tests.fuzz.mutate import hostile


def _span_ok(span, upper: int) -> bool:
    return span is None or (type(span[0]) is int and type(span[1]) is int and 0 <= span[0] < span[1] <= upper)


def _decode(raw, cls):
    """The record, or None where the decoder refused it with a typed error."""
    try:
        record = decode_record(raw, cls)
    except ProtocolError:
        return None
    assert isinstance(record, cls)
    record.validate()  # what decoded once stays valid
    assert encode_record(decode_record(encode_record(record), cls)) == encode_record(record)
    return record


@FUZZ
@given(hostile(RECORDS[PeerInfo]))
@example(b"\x82\xa5model\xa1m\xa7peer_id\xa1\x80")  # a str that is not UTF-8
@counted("records.PeerInfo")
def test_peer_info(raw):
    info = _decode(raw, PeerInfo)
    if info is None:
        return
    assert 0 <= info.max_layers <= MAX_LAYERS and len(info.addrs) <= MAX_ADDRS
    assert all(len(s) <= MAX_STR for s in (info.model, info.peer_id, info.device, info.dtype, *info.addrs))
    for span in (info.serving, info.loading):
        assert _span_ok(span, MAX_LAYERS)
    for table in (info.throughput_decode, info.throughput_prefill):
        assert table == [] or len(table) == info.max_layers
        assert all(math.isfinite(t) and t >= 0 for t in table)
    assert info.kv_free_tokens >= 0 and info.queued_tokens >= 0 and math.isfinite(info.timestamp)


@FUZZ
@given(hostile(RECORDS[LinkInfo]))
@counted("records.LinkInfo")
def test_link_info(raw):
    info = _decode(raw, LinkInfo)
    if info is None:
        return
    assert len(info.links) <= MAX_LINKS and info.peer_id not in info.links
    for stat in info.links.values():
        assert all(math.isfinite(x) and x >= 0 for x in (stat.bandwidth, stat.rtt, stat.measured_at))


@FUZZ
@given(hostile(RECORDS[CoordinatorCandidate]))
@counted("records.CoordinatorCandidate")
def test_candidate(raw):
    cand = _decode(raw, CoordinatorCandidate)
    if cand is None:
        return
    assert 0 < len(cand.public_key) <= 4096 and -(1 << 31) <= cand.priority < 1 << 31
    assert math.isfinite(cand.start_time)


@FUZZ
@given(hostile(RECORDS[MachineInfo]))
@counted("records.MachineInfo")
def test_machine_info(raw):
    info = _decode(raw, MachineInfo)
    if info is None:
        return
    n = len(info.gpus)
    assert 1 <= n <= MAX_MACHINE_GPUS and all(g.memory_bytes >= 1 for g in info.gpus)
    pairs = {(min(l.a, l.b), max(l.a, l.b)) for l in info.links}
    assert len(pairs) == len(info.links) and all(0 <= a < b < n for a, b in pairs)
    assert all(math.isfinite(l.bandwidth) and math.isfinite(l.latency_s) for l in info.links)


@FUZZ
@given(hostile(RECORDS[Plan]))
@counted("records.Plan")
def test_plan(raw):
    plan = _decode(raw, Plan)
    if plan is None:
        return
    assert 1 <= plan.num_layers <= MAX_LAYERS and 0 <= plan.epoch <= MAX_EPOCH
    for span in (*plan.spans.values(), *plan.targets.values()):
        assert _span_ok(span, plan.num_layers)
    for f in plan.flows:
        assert f.src in plan.spans or f.src in (SOURCE, SINK)
        assert f.dst in plan.spans or f.dst in (SOURCE, SINK)
        assert math.isfinite(f.rate) and f.rate >= 0
    cover = plan.coverage()
    assert len(cover) == plan.num_layers and all(0 <= c <= len(plan.spans) for c in cover)
    assert not plan_changed(plan, plan)
    for epoch in (0, MAX_EPOCH):
        with_epoch(plan, epoch).validate()
    graph = RouteGraph.from_plan(plan)  # as the client's router reads it
    assert all(0 <= s < e <= plan.num_layers for s, e in graph.spans.values())


@pytest.mark.parametrize("cls", list(RECORDS))
def test_claimed_size_refused_before_decoding(cls):
    """A record over the size bound is refused without being parsed."""
    with pytest.raises(MalformedFrameError, match="exceeds"):
        decode_record(b"\x80" + bytes(MAX_RECORD_BYTES), cls)
    with pytest.raises(MalformedFrameError):
        decode_record(msgspec.msgpack.encode("x"), cls)
