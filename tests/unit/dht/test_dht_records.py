"""Record encoding, validation bounds and TTLs (pure)."""

import math

import msgspec
import pytest

from p2pserve.dht.records import (
    CoordinatorCandidate,
    Flow,
    LatencyPoints,
    LinkInfo,
    LinkStat,
    PeerInfo,
    Plan,
    RecordRejected,
    decode_record,
    encode_record,
)
from p2pserve.config import ttl_for
from p2pserve.errors import MalformedFrameError


def peer(**kw):
    base = dict(
        model="m", peer_id="p1", max_layers=2, throughput_decode=[100.0, 50.0], throughput_prefill=[800.0, 400.0],
        weights_memory_bytes=1 << 30, kv_memory_bytes=1 << 30, serving=(0, 2), state="serving", timestamp=1.7e9,
    )
    base.update(kw)
    return PeerInfo(**base)


def test_peer_roundtrip():
    p = peer()
    assert decode_record(encode_record(p), PeerInfo) == p
    p = peer(latency=LatencyPoints(prompt=[(1.0, 0.5), (128.0, 4.0)], decode=[(1.0, 0.5), (32.0, 1.5)]),
             kv_entry_bytes=1 << 10)
    assert decode_record(encode_record(p), PeerInfo) == p and p.kv_capacity() == 1 << 20
    assert p.decode_rate(2) == 50.0 and p.decode_rate(3) == 0.0


@pytest.mark.parametrize(
    "kw, fragment",
    [
        (dict(weights_memory_bytes=-1), "weights_memory_bytes"),
        (dict(throughput_decode=[1e12, 1.0]), "throughput_decode[1]"),
        (dict(throughput_decode=[math.nan, 1.0]), "throughput_decode[1]"),
        (dict(throughput_decode=[1.0]), "entries"),
        (dict(serving=(3, 1)), "serving"),
        (dict(serving=(0, 5000)), "serving"),
        (dict(serving=(0, 2), max_layers=1, throughput_decode=[1.0], throughput_prefill=[1.0]), "max_layers"),
        (dict(state="serving", serving=None), "without a serving range"),
        (dict(kv_free_tokens=-5), "kv_free_tokens"),
        (dict(schema=99), "schema"),
        (dict(peer_id=""), "peer_id"),
        (dict(kv_entry_bytes=-1), "kv_entry_bytes"),
        (dict(latency=LatencyPoints(prompt=[], decode=[(1.0, 1.0)])), "latency prompt"),
        (dict(latency=LatencyPoints(prompt=[(1.0, 1.0)], decode=[(1.0, 0.0)])), "latency decode ms"),
        (dict(latency=LatencyPoints(prompt=[(1.0, 1.0)], decode=[(1.0, math.inf)])), "latency decode ms"),
        (dict(latency=LatencyPoints(prompt=[(8.0, 1.0), (2.0, 2.0)], decode=[(1.0, 1.0)])), "increase"),
        (dict(latency=LatencyPoints(prompt=[(0.5, 1.0)], decode=[(1.0, 1.0)])), "latency prompt tokens"),
        (dict(latency=LatencyPoints(prompt=[(float(i), 1.0) for i in range(1, 10)], decode=[(1.0, 1.0)])), "points"),
    ],
)
def test_peer_rejects_absurd(kw, fragment):
    with pytest.raises(RecordRejected) as e:
        decode_record(encode_record(peer(**kw)), PeerInfo)
    assert fragment in e.value.reason


def test_serving_range_checked_against_model_layers():
    with pytest.raises(RecordRejected):
        peer(serving=(0, 2)).validate(num_layers=1)
    peer().validate(num_layers=2)


def test_malformed_bytes():
    with pytest.raises(MalformedFrameError):
        decode_record(b"\x93garbage", PeerInfo)
    with pytest.raises(MalformedFrameError):
        decode_record(msgspec.msgpack.encode({"model": "m", "peer_id": 5}), PeerInfo)
    with pytest.raises(MalformedFrameError):
        decode_record("not bytes", PeerInfo)  # type: ignore[arg-type]


def test_link_info_bounds():
    ok = LinkInfo(model="m", peer_id="a", links={"b": LinkStat(bandwidth=1e8, rtt=0.01)})
    assert decode_record(encode_record(ok), LinkInfo) == ok
    for stat in (LinkStat(bandwidth=-1, rtt=0.1), LinkStat(bandwidth=1e15, rtt=0.1), LinkStat(bandwidth=1e6, rtt=1e4)):
        with pytest.raises(RecordRejected):
            LinkInfo(model="m", peer_id="a", links={"b": stat}).validate()
    with pytest.raises(RecordRejected):
        LinkInfo(model="m", peer_id="a", links={"a": LinkStat(bandwidth=1, rtt=0)}).validate()


def test_candidate_and_plan():
    c = CoordinatorCandidate(model="m", coordinator_id="c", start_time=1.0, public_key="ssh-rsa AAAA")
    assert decode_record(encode_record(c), CoordinatorCandidate) == c
    plan = Plan(model="m", epoch=3, leader_id="c", num_layers=4, targets={"a": (0, 4)}, spans={"a": (0, 4)},
                flows=[Flow("source", "a", 10.0), Flow("a", "sink", 10.0)], max_flow=10.0)
    assert decode_record(encode_record(plan), Plan) == plan
    assert plan.coverage() == [1, 1, 1, 1]
    with pytest.raises(RecordRejected):
        Plan(model="m", epoch=1, leader_id="c", num_layers=4, spans={"a": (0, 4)}, flows=[Flow("a", "ghost", 1.0)]).validate()
    with pytest.raises(RecordRejected):
        Plan(model="m", epoch=1, leader_id="c", num_layers=4, targets={"a": (2, 9)}).validate()
    with pytest.raises(RecordRejected):
        Plan(model="m", epoch=1, leader_id="c", num_layers=4, spans={"a": (0, 4)}, flows=[Flow("source", "a", -1.0)]).validate()


def test_ttl():
    assert ttl_for(5.0, 2.0) == 10.0
    assert ttl_for(0.1, 2.0) == 2.0
