"""The last hop's sampling extras (peer/sampling.py, peer/forward_checks.py) and the client's
checks of what comes back (client/logprobs.py), on plain tensors and structs."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from p2pserve.client.logprobs import check_logprobs, unpack
from p2pserve.errors import BadRequestError, MalformedFrameError
from p2pserve.peer.forward_checks import last_hop_ask
from p2pserve.peer.sampling import Ask, allowed_tokens, choose, logprob_rows, mask_words, sample_token, shape_logits
from p2pserve.protocol import Forward, Logprobs, SamplingParams, TensorMeta

V = 50


def logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed))


def test_repetition_penalty_is_transformers_rule():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    x, history = logits(), [3, 7, 7, 11]
    ours = shape_logits(x, SamplingParams(repetition_penalty=1.7), history)
    theirs = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([history]), x.clone().unsqueeze(0))[0]
    assert torch.allclose(ours, theirs)


def test_presence_and_frequency_count_generated_tokens_only():
    x = logits()
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, penalty_start=2)
    out = shape_logits(x, p, [4, 4, 9, 9, 9, 4])  # positions 0-1 are the prompt
    expected = x.clone()
    expected[9] -= 0.25 * 3 + 0.5
    expected[4] -= 0.25 * 1 + 0.5
    assert torch.allclose(out, expected)


def test_logit_bias_min_p_and_mask():
    x = logits()
    assert sample_token(x, SamplingParams(logit_bias=[(13, 100.0)]), 5) == 13
    mask = np.zeros(mask_words(V), dtype="<i4")
    mask[1] = 1 << 3  # only token 35
    assert sample_token(x, SamplingParams(temperature=1.0, seed=3), 9, allowed=mask.tobytes()) == 35
    assert allowed_tokens(mask.tobytes(), V).nonzero().flatten().tolist() == [35]
    with pytest.raises(BadRequestError):
        sample_token(x, SamplingParams(), 1, allowed=np.zeros(mask_words(V), dtype="<i4").tobytes())
    # min_p 1.0 keeps only the most likely token, whatever the draw
    assert {sample_token(x, SamplingParams(temperature=2.0, min_p=1.0, seed=s), 4) for s in range(20)} == {int(x.argmax())}


def test_choose_returns_raw_logprobs_of_prompt_and_sampled_tokens():
    rows = torch.stack([logits(i) for i in range(4)])  # rows at positions 2..5 of a 6-token history
    history = [1, 2, 3, 4, 5, 6]
    choice = choose(rows, SamplingParams(logprobs=True, top_logprobs=3, repetition_penalty=1.3), 3,
                    Ask(history=history, prompt_rows=3))
    ref = torch.log_softmax(rows, -1)
    prompt = unpack(check_logprobs(choice.prompt_logprobs, 3, 3, V), history[3:6])
    assert [round(e.logprob, 5) for e in prompt] == [round(ref[i, history[3 + i]].item(), 5) for i in range(3)]
    (sampled,) = unpack(check_logprobs(choice.logprobs, 1, 3, V), choice.tokens)
    assert abs(sampled.logprob - ref[3, choice.tokens[0]].item()) < 1e-6  # raw, before the penalty
    assert [t for t, _ in sampled.top] == torch.topk(ref[3], 3).indices.tolist()


def _lp(**kw) -> Logprobs:
    good = logprob_rows(torch.stack([logits(0), logits(1)]), [1, 2], 2)
    return msgspec.structs.replace(good, **kw)


@pytest.mark.parametrize("bad", [
    dict(count=3), dict(k=1), dict(chosen=b"\0" * 4),
    dict(chosen=np.array([0.5, -1.0], "<f4").tobytes()),  # a log-probability above 0
    dict(chosen=np.array([np.nan, -1.0], "<f4").tobytes()),
    dict(top_ids=np.array([0, 1, 2, V], "<i4").tobytes()),  # outside the vocabulary
])
def test_hostile_logprobs_are_refused(bad):
    check_logprobs(_lp(), 2, 2, V)
    with pytest.raises(MalformedFrameError):
        check_logprobs(_lp(**bad), 2, 2, V)
    with pytest.raises(MalformedFrameError):
        check_logprobs(None, 2, 2, V)


class _Spec:
    num_layers, vocab_size = 4, V


class _Session:
    def __init__(self, end=4, sampling=SamplingParams()):
        self.end, self.sampling, self.tokens = end, sampling, []


def _forward(n: int, position: int = 0, **kw) -> Forward:
    return Forward(session_id="s", step=0, position=position, tensor=TensorMeta("float32", [n, 8], n * 32), **kw)


def test_last_hop_fields_are_checked_before_anything_runs():
    s = _Session(sampling=SamplingParams(presence_penalty=1.0))
    for msg, needle in [
        (_forward(2), "need the Forward's context"),
        (_forward(2, context=[1]), "must hold the Forward's 2"),
        (_forward(2, context=[1, V]), "must be in"),
        (_forward(2, position=3, context=[1, 2]), "history stops at 0"),
        (_forward(1, context=[1], allowed=b"\0" * 3), "bitmask"),
    ]:
        with pytest.raises(BadRequestError, match=needle):
            last_hop_ask(_Spec, s, msg, msg.tensor.shape[0])
    with pytest.raises(BadRequestError, match="last layer"):
        last_hop_ask(_Spec, _Session(end=2), _forward(1, context=[1]), 1)
    ask = last_hop_ask(_Spec, s, _forward(2, context=[5, 6]), 2)
    assert ask.history == [5, 6] and s.tokens == [5, 6]
    last_hop_ask(_Spec, s, _forward(1, position=1, context=[9]), 1)  # a rewind truncates first
    assert s.tokens == [5, 9]
    assert last_hop_ask(_Spec, _Session(), _forward(1), 1) is None  # the plain path stays plain


def test_sampling_params_bounds():
    assert SamplingParams(min_p=0.1, presence_penalty=-2, logit_bias=[(1, 100.0)]).validate() is None
    for bad in [dict(min_p=1.5), dict(repetition_penalty=0.0), dict(frequency_penalty=2.5), dict(top_logprobs=21),
                dict(logit_bias=[(1, 101.0)])]:
        assert SamplingParams(**bad).validate() is not None


def test_prompt_logprobs_are_bounded_by_the_logits_they_hold():
    class Wide(_Spec):
        vocab_size = 1 << 20  # 4 MiB of logits a row

    n = 65  # 260 MiB of logits
    with pytest.raises(BadRequestError, match="MiB"):
        last_hop_ask(Wide, _Session(), _forward(n, context=[1] * n, prompt_logprobs=True), n)
