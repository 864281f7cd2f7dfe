"""The model's shape from the peers' announcements: the record fields, the majority rule, the
coordinator's check of peers against the adopted shape, and the learner's settle window."""

from __future__ import annotations

import asyncio
import logging

import msgspec
import pytest

from p2pserve.config import CoordinatorConfig, DHTConfig
from p2pserve.coordinator.service import CoordinatorService, learn_shape
from p2pserve.coordinator.shape import Shape, agree, announced, mismatched
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.records import PeerInfo, RecordRejected, decode_record, encode_record
from p2pserve.testing.swarm import FakeSwarm, FakeSwarmStore

A = Shape(8, 1024)
B = Shape(4, 1024)


def info(pid: str, shape: Shape | None = A, **kw) -> PeerInfo:
    s = dict(num_layers=shape.num_layers, activation_bytes=shape.activation_bytes) if shape else {}
    return PeerInfo(model="m", peer_id=pid, **s, **kw)


# ---------------------------------------------------------------------------------- the record


def test_peer_info_carries_the_shape_and_bounds_it():
    rec = decode_record(encode_record(info("p")), PeerInfo)
    assert announced(rec) == A
    for bad in (dict(num_layers=-1), dict(num_layers=5000), dict(activation_bytes=-4), dict(activation_bytes=1 << 21)):
        with pytest.raises(RecordRejected):
            decode_record(encode_record(PeerInfo(model="m", peer_id="p", **bad)), PeerInfo)
    with pytest.raises(msgspec.ValidationError):  # typed: a string is not a layer count
        msgspec.convert({"model": "m", "peer_id": "p", "num_layers": "8"}, PeerInfo)


def test_older_records_without_a_shape_still_decode():
    legacy = msgspec.msgpack.encode({"model": "m", "peer_id": "p"})
    rec = decode_record(legacy, PeerInfo, num_layers=8)
    assert announced(rec) is None


def test_a_reader_knowing_the_depth_drops_a_peer_announcing_another():
    with pytest.raises(RecordRejected, match="announces a model of 4 layers; this model has 8"):
        decode_record(encode_record(info("p", B)), PeerInfo, num_layers=8)


def test_the_announced_depth_bounds_the_peer_own_ranges():
    with pytest.raises(RecordRejected, match="serving"):
        info("p", B, serving=(0, 6), state="serving").validate()


# ---------------------------------------------------------------------------------- the rule


def test_no_announcement_decides_nothing():
    assert agree({}).shape is None
    verdict = agree({"p": info("p", None)})
    assert verdict.shape is None and "announce none" in verdict.reason


def test_the_majority_of_distinct_signers_wins_and_the_rest_are_refused():
    peers = {"p1": info("p1"), "p2": info("p2"), "p3": info("p3", B), "old": info("old", None)}
    verdict = agree(peers)
    assert verdict.shape == A
    assert set(verdict.refused) == {"p3"}
    assert "4 layers" in verdict.refused["p3"] and "8 layers" in verdict.refused["p3"]
    assert "conflicting" in verdict.reason and "...p3" in verdict.reason


def test_a_tie_decides_nothing_and_names_both_sides():
    verdict = agree({"p1": info("p1"), "p2": info("p2", B)})
    assert verdict.shape is None and not verdict.refused
    assert "no majority" in verdict.reason and "...p1" in verdict.reason and "...p2" in verdict.reason


def test_the_verdict_does_not_depend_on_read_order():
    peers = {f"p{i}": info(f"p{i}", A if i % 3 else B) for i in range(7)}
    assert agree(dict(reversed(list(peers.items())))) == agree(peers)


def test_mismatched_compares_only_what_both_sides_give():
    peers = {"same": info("same"), "deep": info("deep", B), "wide": info("wide", Shape(8, 2048)), "old": info("old", None)}
    assert set(mismatched(peers, A)) == {"deep", "wide"}
    assert set(mismatched(peers, Shape(8, 0))) == {"deep"}  # activation size set by the operator


# ---------------------------------------------------------------------------------- the shells


class Ticks:
    """A monotonic clock that advances one second per reading."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def test_learn_shape_waits_for_a_settled_majority(caplog):
    store = FakeSwarmStore()
    coord = FakeSwarm(store, "coord")

    def announce(pid, shape):  # synchronous: the clock below announces from inside the learner's loop
        store.put(RecordKind.PEERS, f"key-{pid}", info(pid, shape))

    announce("p1", B)  # a stray peer first: its shape leads, but not for the settle window
    clock = Ticks()

    def later():  # the honest peers announce two reads later, within the window
        if clock.t == 2.0:
            announce("p2", A)
            announce("p3", A)
        return clock()

    async def go():
        return await learn_shape(coord, asyncio.Event(), period=0.0, settle=3.0, clock=later)

    with caplog.at_level(logging.INFO, logger="p2pserve.coordinator.service"):
        assert asyncio.run(go()) == A
    assert "refusing peer p1's shape" in caplog.text


def test_learn_shape_returns_none_when_stopped():
    async def go():
        stop = asyncio.Event()
        stop.set()
        return await learn_shape(FakeSwarm(), stop, period=0.0, settle=0.0)

    assert asyncio.run(go()) is None


def test_the_service_leaves_peers_of_another_shape_out_of_its_snapshot(caplog):
    store = FakeSwarmStore()
    dcfg = DHTConfig(model="m")
    for pid, shape in (("p1", A), ("p2", Shape(8, 2048))):
        asyncio.run(FakeSwarm(store, pid, dcfg).announce_peer(info(pid, shape)))
    service = CoordinatorService(FakeSwarm(store, "coord", dcfg), CoordinatorConfig(num_layers=8, check_claims=False),
                                 shape=A)
    with caplog.at_level(logging.WARNING, logger="p2pserve.coordinator.service"):
        snap = asyncio.run(service._snapshot(0.0))
    assert set(snap.peers) == {"p1"}
    assert "leaving peer p2 out of the plan" in caplog.text and "2048" in caplog.text
