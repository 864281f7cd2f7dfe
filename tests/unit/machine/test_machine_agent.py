"""The machine agent's pure decisions (machine/agent.py), its flags (cli/machine.py) and the slot
link measurement (peer/slot_links.py: the fit, the parser of rank 0's line, and a real two-process
gloo measurement)."""

from __future__ import annotations

import argparse

import pytest

from p2pserve.cli.machine import add_arguments, parse_grouping, peer_args
from p2pserve.dht.records import PeerInfo
from p2pserve.errors import ConfigError
from p2pserve.machine.agent import may_stop, slot_sets, transition
from p2pserve.peer.slot_links import LARGE_BYTES, MARK, SMALL_BYTES, fit_pair, measure_links, pairs, parse_result


def peer(serving, state="serving"):
    return PeerInfo(model="m", peer_id="p", device="cpu", dtype="float32", max_layers=8, serving=serving, state=state,
                    throughput_decode=[1.0] * 8)


def test_slot_sets_and_transition():
    assert slot_sets([2, 1, 1]) == [(0, 1), (2,), (3,)]
    assert transition([(0,), (1,)], [(0, 1)]) == ([(0, 1)], [(0,), (1,)])
    assert transition([(0, 1)], [(0, 1)]) == ([], [])
    assert transition([(0, 1), (2,)], [(0, 1), (2, 3)]) == ([(2, 3)], [(2,)])


def test_a_retired_group_stops_only_when_its_layers_are_served_by_a_peer_not_draining():
    old = {"a": peer((0, 4), "draining"), "b": peer((4, 8), "draining")}
    assert not may_stop("a", old)  # nobody else serves [0, 4): b drains too
    assert not may_stop("a", {**old, "c": peer((2, 8))})  # [0, 2) still only on a
    assert may_stop("a", {**old, "c": peer((0, 8))})
    assert not may_stop("a", {**old, "c": peer((0, 8), "draining")})
    assert may_stop("a", {"a": peer(None, "draining")})  # serves nothing
    assert not may_stop("missed", old)  # a read that missed its record: wait for the next


def test_flags():
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", "M", "--initial-peers", "X", "Y", "--slots", "2", "--slot-max-layers", "4",
                         "--plan-refresh", "2", "--", "--kv-memory-gb", "1"])
    out = peer_args(args)
    assert out[out.index("--initial-peers") + 1:][:2] == ("X", "Y") and "--plan-refresh" in out
    assert out[-2:] == ("--kv-memory-gb", "1") and "--" not in out
    assert parse_grouping("plan", 4) is None and parse_grouping("2,1,1", 4) == (2, 1, 1)
    for bad in ("2,2,1", "3,1", "x"):
        with pytest.raises(ConfigError):
            parse_grouping(bad, 4)


def test_fit_and_parse():
    bw, lat = fit_pair(SMALL_BYTES, 100e-6, LARGE_BYTES, 100e-6 + LARGE_BYTES / 2e9)
    assert bw == pytest.approx(2e9, rel=1e-3) and lat == pytest.approx(100e-6)
    assert fit_pair(SMALL_BYTES, 1e-3, LARGE_BYTES, 5e-4)[0] == 1e12  # noise: the ceiling, not a negative figure
    assert pairs(3) == [(0, 1), (0, 2), (1, 2)]
    links = parse_result(MARK + "[[0, 1, 0.0001, 0.002]]", 2, "other")
    assert len(links) == 1 and links[0].bandwidth > 0
    for bad in ("", MARK + "[[0, 0, 1, 2]]", MARK + "[[0, 5, 1, 2]]", MARK + "{}", MARK + "[[0, 1, -1, 2]]"):
        with pytest.raises(ConfigError):
            parse_result(bad, 2, "other")


def test_two_cpu_slots_are_measured_over_gloo():
    (link,) = measure_links(["cpu", "cpu"], timeout_s=60)
    assert (link.a, link.b, link.kind) == (0, 1, "other")
    assert 0 < link.bandwidth <= 1e12 and 0 <= link.latency_s < 1.0
