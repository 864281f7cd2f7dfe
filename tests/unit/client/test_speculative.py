"""Speculative decoding: drafts, acceptance, the sampler's distribution, adaptive k, wire bounds,
and the real client over fake peers (token-identical output, failover, fewer Forwards)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch
from scipy.stats import chisquare

from p2pserve.client.api import AsyncClient
from p2pserve.client.connection import HopConnection
from p2pserve.client.drafts import DraftModel, PromptLookup, check_speculative, make_drafter
from p2pserve.client.hop import Hop
from p2pserve.client.speculative import SpeculationTuner, accept, choose_k, expected_tokens
from p2pserve.config import SpeculativeConfig
from p2pserve.config import ClientConfig
from p2pserve.errors import BadRequestError, ConfigError, MalformedFrameError, UnknownModelError
from p2pserve.peer.forward_checks import check_forward
from p2pserve.peer.sampling import sample_token, sample_tokens
from p2pserve.protocol import (MAX_VERIFY_OUTPUTS, Forward, ForwardResult, FrameLimits, SamplingParams, TensorMeta,
                               decode_reply, decode_request)
from p2pserve.testing import FakePeerNetwork
from p2pserve.testing.peers import OracleDrafter


# ----------------------------------------------------------------------------- drafts

def test_prompt_lookup_copies_what_followed_the_latest_match_of_the_longest_suffix():
    pl = PromptLookup(ngram_max=3, ngram_min=1)
    ctx = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert pl.propose(ctx, 2) == [7, 8]  # the latest earlier [1, 2, 3] is followed by 7, 8
    assert pl.propose(ctx, 10) == [7, 8, 5, 1, 2, 3]  # up to the end of the context
    assert pl.propose([4, 5, 6, 5], 3) == [6, 5]  # only a 1-gram matches
    assert pl.propose([1, 2, 3], 4) == [] and pl.propose([1], 4) == [] and pl.propose(ctx, 0) == []


def test_speculative_names_are_checked():
    for ok in (None, "off", "prompt-lookup", "draft:/x"):
        check_speculative(ok)
    for bad in ("draft:", "ngram", "prompt_lookup"):
        with pytest.raises(ConfigError):
            check_speculative(bad)
    assert make_drafter(None, 10) is None and isinstance(make_drafter("prompt-lookup", 10), PromptLookup)


def test_draft_model_proposes_its_greedy_tokens_and_refuses_another_vocabulary(tmp_path):
    from transformers import AutoModelForCausalLM

    from p2pserve.model.tiny import build_tiny_model

    path = build_tiny_model("llama", tmp_path / "draft", seed=3, num_layers=2)
    with pytest.raises(ConfigError, match="vocabulary"):
        DraftModel(path, vocab_size=12345)
    with pytest.raises(UnknownModelError):
        DraftModel(tmp_path / "nowhere", vocab_size=12345)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    draft = DraftModel(path, vocab_size=vocab).session()
    context = [5, 17, 42, 9, 33]
    ref = model.generate(torch.tensor([context]), max_new_tokens=4, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    assert draft.propose(context, 4) == ref
    # a rejected draft: the next context shares a prefix with the cache, which is cropped to it
    context2 = context + ref[:2] + [(ref[2] + 1) % vocab]
    ref2 = model.generate(torch.tensor([context2]), max_new_tokens=3, do_sample=False,
                          pad_token_id=0)[0, len(context2):].tolist()
    assert draft.propose(context2, 3) == ref2


# ----------------------------------------------------------------------------- acceptance and k

def test_accept_keeps_the_agreeing_draft_and_one_target_token():
    assert accept([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert accept([1, 2, 3], [1, 5, 3, 4]) == [1, 5]
    assert accept([1, 2, 3], [7, 2, 3, 4]) == [7]
    assert accept([], [7]) == [7]
    with pytest.raises(ValueError):
        accept([1, 2], [1, 2])


def test_choose_k_maximises_expected_tokens_per_second():
    def brute(a, t0, t_tok, max_k):
        rates = [expected_tokens(a, k) / (t0 + k * t_tok) for k in range(max_k + 1)]
        return rates.index(max(rates))

    for a in (0.0, 0.2, 0.5, 0.8, 0.95):
        for ratio in (0.0, 0.01, 0.1, 0.5, 2.0):
            assert choose_k(a, 1.0, ratio, 8) == brute(a, 1.0, ratio, 8)
    assert choose_k(0.0, 1.0, 0.1, 8) == 0  # nothing is ever accepted: do not draft
    assert choose_k(0.9, 50e-3, 0.5e-3, 8) == 8  # WAN: a step is latency, extra tokens cheap
    assert choose_k(0.5, 1e-3, 1e-3, 8) == 0  # compute-bound: every token costs a full step
    assert expected_tokens(1.0, 4) == 5 and expected_tokens(0.0, 4) == 1


def test_tuner_measures_acceptance_and_latency_and_probes_again():
    tuner = SpeculationTuner(SpeculativeConfig(max_k=8, smoothing=0.3, probe_every=4))
    for k in (0, 2, 4, 0, 3, 1) * 5:  # steps take 10 ms + 1 ms per draft token; drafts always accepted
        tuner.observe(k, k, 0.010 + 0.001 * k)
    t0, t_tok = tuner.step_time()
    assert t0 == pytest.approx(0.010, rel=1e-3) and t_tok == pytest.approx(0.001, rel=1e-3)
    assert tuner.acceptance > 0.95 and tuner.next_k(room=100) == 8 and tuner.next_k(room=3) == 3
    for _ in range(30):  # nothing accepted any more: k falls to 0 ...
        tuner.observe(2, 0, 0.012)
    assert tuner.acceptance < 0.05 and tuner.next_k(room=100) == 0
    for _ in range(4):  # ... and after probe_every steps without a draft, one token is tried
        tuner.observe(0, 0, 0.010)
    assert tuner.next_k(room=100) == 1
    assert tuner.next_k(room=0) == 0
    fixed = SpeculationTuner(SpeculativeConfig(max_k=5, adaptive=False))
    fixed.observe(5, 0, 1.0)
    assert fixed.next_k(room=100) == 5 and fixed.next_k(room=2) == 2


def test_speculative_config_is_bounded():
    with pytest.raises(ConfigError):
        SpeculativeConfig(max_k=MAX_VERIFY_OUTPUTS)
    with pytest.raises(ConfigError):
        SpeculativeConfig(ngram_min=3, ngram_max=2)


# ----------------------------------------------------------------------------- the sampler's distribution

def _tiny_logits(tmp_path, prefix, draft_token):
    """fp32 logits [3, V] of a tiny model after prefix, prefix + [d], prefix + [d, d]."""
    from transformers import AutoModelForCausalLM

    from p2pserve.model.tiny import build_tiny_model

    path = build_tiny_model("llama", tmp_path / "m", seed=0, num_layers=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model(torch.tensor([prefix + [draft_token, draft_token]])).logits[0, -3:]
    return out.float()


def test_speculative_sampling_follows_the_target_distribution(tmp_path):
    """Chi-square over 3000 seeds: the first token of a speculative step (draft [d, d]) has the
    target's softmax distribution, and the second token, given that the first was d, the target's
    conditional one; and every step yields exactly what one-token steps would have sampled."""
    params = SamplingParams(temperature=0.3, seed=0)  # the top tokens hold 0.3, 0.19, 0.15: many bins, d often drawn
    prefix = [7, 21, 40, 3]
    base = _tiny_logits(tmp_path, prefix, 0)[0]
    probs0 = torch.softmax(base / params.temperature, -1)
    d = int(torch.argsort(probs0, descending=True)[1])  # the second most likely: accepted sometimes
    logits = _tiny_logits(tmp_path, prefix, d)
    p0, p1 = (torch.softmax(row / params.temperature, -1) for row in logits[:2])
    firsts, seconds = [], []
    for seed in range(3000):
        sp = SamplingParams(temperature=params.temperature, seed=seed)
        tokens = accept([d, d], sample_tokens(logits, sp, len(prefix)))
        one_by_one = [sample_token(logits[0], sp, len(prefix))]
        if one_by_one[0] == d:
            one_by_one.append(sample_token(logits[1], sp, len(prefix) + 1))
        assert tokens[:2] == one_by_one
        firsts.append(tokens[0])
        if tokens[0] == d:
            seconds.append(tokens[1])
    assert 100 < len(seconds) < 2900  # the draft was both accepted and rejected
    for sample, p in ((firsts, p0), (seconds, p1)):
        _assert_follows(sample, p)


def _assert_follows(sample: list[int], p: torch.Tensor) -> None:
    """Chi-square goodness of fit of ``sample`` to ``p`` (bins of expected count >= 5, rest pooled)."""
    n = len(sample)
    counts = torch.bincount(torch.tensor(sample), minlength=p.shape[0]).double()
    expected = p.double() * n
    big = expected >= 5
    obs = counts[big].tolist() + [float(counts[~big].sum())]
    exp = expected[big].tolist() + [float(expected[~big].sum())]
    if exp[-1] < 5:  # pool the small bins into the smallest big one instead
        obs, exp = obs[:-1], exp[:-1]
        obs[-1] += float(counts[~big].sum())
        exp[-1] += float(expected[~big].sum())
    assert len(exp) >= 5, "the distribution is too peaked for this test"
    scale = sum(obs) / sum(exp)
    assert chisquare(obs, [e * scale for e in exp]).pvalue > 1e-3


# ----------------------------------------------------------------------------- wire bounds

def _forward(**fields) -> bytes:
    msg = {"t": "forward", "session_id": "s", "step": 0, "position": 0,
           "tensor": {"dtype": "int64", "shape": [4], "nbytes": 32}, **fields}
    return msgspec.msgpack.encode(msg)


def test_outputs_are_bounded_by_the_decoder_and_checked_against_the_session():
    assert decode_request(_forward()).outputs == 1
    assert decode_request(_forward(outputs=4)).outputs == 4
    for hostile in (0, -1, MAX_VERIFY_OUTPUTS + 1, 2**64 - 1, "4", None, 1.5):
        with pytest.raises(MalformedFrameError):
            decode_request(_forward(outputs=hostile))
    too_many = {"t": "result", "session_id": "s", "step": 0, "position": 1, "tokens": [1] * (MAX_VERIFY_OUTPUTS + 1)}
    with pytest.raises(MalformedFrameError):
        decode_reply(msgspec.msgpack.encode(too_many))

    class Spec:
        num_layers, vocab_size, hidden_size, dtype = 8, 100, 4, "float32"

    class Session:
        start, end, position, max_length = 0, 8, 0, 64

    ids = torch.tensor([1, 2, 3], dtype=torch.int64)
    meta = TensorMeta("int64", [3], 24)
    check_forward(Spec, Session, Forward("s", 0, 0, meta, outputs=3), ids)
    with pytest.raises(BadRequestError, match="outputs=4"):
        check_forward(Spec, Session, Forward("s", 0, 0, meta, outputs=4), ids)  # more outputs than tokens
    Session.end = 6
    with pytest.raises(BadRequestError, match="last layer"):
        check_forward(Spec, Session, Forward("s", 0, 0, meta, outputs=2), ids)  # not the last hop
    check_forward(Spec, Session, Forward("s", 0, 0, meta), ids)


def test_the_client_checks_the_tokens_a_last_hop_returns():
    link = HopConnection(None, Hop("p", 0, 8, ()), FrameLimits(), 1.0)

    def check(**fields):
        reply = ForwardResult(session_id="s", step=0, position=4, **fields)
        return link.check_forward(reply, b"", 4, 0, 0, True, vocab_size=100, outputs=3)

    assert check(tokens=[1, 2, 3]) is None
    for bad in ({"tokens": [1, 2]}, {"tokens": [1, 2, 3, 4]}, {"token": 1}, {"tokens": [1, 2, 100]}):
        with pytest.raises(MalformedFrameError):
            check(**bad)


# ----------------------------------------------------------------------------- the client over fake peers

def _generate(drafter=None, kill_after=None, max_new_tokens=40, prompt=(5, 6, 7, 8) * 5):
    net = FakePeerNetwork(num_layers=8)
    hops = [net.add("a", 0, 3), net.add("b", 3, 6), net.add("c", 6, 8), net.add("c2", 6, 8)]
    if kill_after is not None:
        net.kill_after["c"] = kill_after

    async def main():
        peers = [f"{h.maddrs[0]}@{h.start}:{h.end}" for h in hops]
        async with AsyncClient(peers=peers, model_info=net.model_info(), transport=net.client(), seed=0,
                               config=ClientConfig(direct=False, verify_share=0),
                               speculative_config=SpeculativeConfig(max_k=4, adaptive=False)) as client:
            client.drafter = drafter
            reply = await client.generate(list(prompt), max_new_tokens=max_new_tokens, ignore_eos=True)
            return reply.tokens

    return asyncio.run(main()), net


@pytest.mark.parametrize("drafter", [PromptLookup(), OracleDrafter(wrong_every=4), OracleDrafter(wrong_every=0)],
                         ids=["prompt-lookup", "oracle-with-misses", "oracle"])
def test_speculative_output_is_token_identical_with_fewer_forwards(drafter):
    plain, plain_net = _generate()
    ours, net = _generate(drafter)
    assert ours == plain and len(ours) == 40
    if isinstance(drafter, OracleDrafter):  # several tokens a step (k = 4 always: no timing involved)
        assert len(net.sampled) < len(plain_net.sampled) / 2


def test_failover_during_speculation_replays_only_accepted_tokens():
    plain, _ = _generate()
    ours, net = _generate(OracleDrafter(wrong_every=3), kill_after=5)
    assert ours == plain
    assert max(net.sampled) > 20  # the replay: the whole history as one prefill on the other replica
