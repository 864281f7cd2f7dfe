"""Who touched which outputs (client/trust/rollback.py): the position a caught peer's request rolls back to."""

from __future__ import annotations

from types import SimpleNamespace

from p2pserve.client.hop import Hop
from p2pserve.client.trust.rollback import Suspects
from p2pserve.client.trust.session import VerifiedSession
from p2pserve.client.trust.tape import HopTape


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
    verifier = SimpleNamespace(excluded={})
    trust = VerifiedSession(verifier)
    s = trust.suspects
    s.stepped(_tapes(0, 3))
    assert trust.rollback_from() is None
    verifier.excluded = {"b": "outvoted"}
    assert trust.rollback_from() == 3
    trust.forget_caught()
    assert trust.rollback_from() is None and s.first_out == {"a": 3}


def _generate(withdraw: bool):
    """8 greedy tokens after [1, 2, 3] over fake peers; the first route's last hop returns wrong
    tokens and is convicted after the 4th step. Returns (tokens yielded, the Generation)."""
    import asyncio

    from p2pserve.client.generation import Generation
    from p2pserve.client.params import GenerationParams
    from p2pserve.client.pipeline import Pipeline
    from p2pserve.client.route_providers import ChainListRoutes
    from p2pserve.config import ClientConfig, PushConfig
    from p2pserve.testing import FakePeerNetwork, ScriptedVerifier

    net = FakePeerNetwork(num_layers=8)
    a, liar, honest = net.add("a", 0, 4), net.add("liar", 4, 8), net.add("b", 4, 8)
    net.corrupt["liar"] = "wrong"
    # tapes are kept only while verifying; the fake peers take driven steps only
    config = ClientConfig(verify_share=0.5, push=PushConfig())

    async def go():
        p = Pipeline(net.client(), ChainListRoutes([[a, liar], [a, honest]]), "fake-model", 8, max_length=64,
                     config=config, trust=ScriptedVerifier("liar", after=4).session())
        gen = Generation(p, [1, 2, 3], GenerationParams(max_new_tokens=8, ignore_eos=True), set())
        gen.withdraw = withdraw
        try:
            return [e.token async for e in gen], gen
        finally:
            await p.close()

    return asyncio.run(go())


def _greedy(history: list[int], n: int) -> list[int]:
    from p2pserve.testing import fake_next_token

    out = []
    for _ in range(n):
        out.append(fake_next_token(history + out))
    return out


def test_a_convicted_peers_tokens_are_withdrawn_and_regenerated_without_it():
    yielded, gen = _generate(withdraw=True)
    assert gen.result.tokens == _greedy([1, 2, 3], 8)  # identical to an honest run
    assert gen.rolled_back == 4  # the liar had a hand in every token from the first on
    assert yielded[:4] != gen.result.tokens[:4]  # they had been handed out, wrong
    assert [h.peer_id for h in gen.pipeline.route] == ["a", "b"]


def test_a_stream_keeps_what_it_sent_and_only_changes_route():
    yielded, gen = _generate(withdraw=False)
    assert gen.rolled_back == 0 and gen.result.tokens == yielded
    assert gen.result.tokens[4:] == _greedy([1, 2, 3] + gen.result.tokens[:4], 4)  # continued honestly
    assert [h.peer_id for h in gen.pipeline.route] == ["a", "b"]
