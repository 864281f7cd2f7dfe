"""Who touched which outputs (client/rollback.py): the position a caught peer's request rolls back to."""

from __future__ import annotations

from types import SimpleNamespace

from p2pserve.client.hop import Hop
from p2pserve.client.rollback import Suspects, suspect_from
from p2pserve.client.tape import HopTape


def _tapes(position: int, count: int, tokens=None) -> list[HopTape]:
    reply = SimpleNamespace(token=7, tokens=tokens, signature=b"")
    tapes = [HopTape(Hop("a", 0, 4, ()), "s1"), HopTape(Hop("b", 4, 8, ()), "s2")]
    for t in tapes:
        t.record(position, count, "int64", b"\0" * 8 * count, reply, b"")
    return tapes


def test_the_first_token_each_peer_touched_is_kept():
    s = Suspects()
    s.stepped(_tapes(0, 5))  # the prompt's prefill returns the token at position 5
    s.stepped(_tapes(5, 1))  # a decode step: position 6; a and b keep 5
    assert s.first_out == {"a": 5, "b": 5}
    later = [HopTape(Hop("c", 0, 4, ()), "s3"), _tapes(6, 1)[1]]  # a failover: c joins at position 7
    later[0].record(0, 7, "int64", b"\0" * 56, later[1].last.reply, b"")
    s.stepped(later)
    assert s.first_out["c"] == 7


def test_a_speculative_step_touched_its_first_output():
    s = Suspects()
    s.stepped(_tapes(10, 4, tokens=[1, 2, 3]))  # outputs after each of the last 3 of 4 inputs: 12, 13, 14
    assert s.first_out == {"a": 12, "b": 12}


def test_only_caught_peers_roll_back_and_only_once():
    s = Suspects()
    s.stepped(_tapes(0, 3))
    pipeline = SimpleNamespace(verifier=SimpleNamespace(excluded={}), suspects=s)
    assert suspect_from(pipeline) is None
    pipeline.verifier.excluded = {"b": "outvoted"}
    assert suspect_from(pipeline) == 3
    s.forget(pipeline.verifier.excluded)
    assert suspect_from(pipeline) is None and s.first_out == {"a": 3}
    assert suspect_from(SimpleNamespace()) is None  # no verifier: nothing to roll back
