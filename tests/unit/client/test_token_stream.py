"""The client's per-token path: text from a short window per token, equal to decoding the whole
reply, and a step that answers several tokens at once."""

from __future__ import annotations

import asyncio
import random

import pytest

from p2pserve.client.generation import Generation
from p2pserve.client.params import GenerationParams
from p2pserve.client.textstream import IncrementalDetokenizer
from p2pserve.testing import ByteTokenizer, InstantPipeline

TEXTS = [
    "The keeper climbed the stairs at dusk, as he had every evening for thirty-one years.",
    "naïve café — 😀 日本語のテキスト, «quoted» and \"escaped\"\n\tindented",
    " leading space, then   several   spaces",
]


@pytest.fixture(scope="module")
def bpe():
    """The tiny models' byte-level BPE tokenizer (trained offline)."""
    from p2pserve.model.tiny import build_tokenizer

    return build_tokenizer()


def streamed(tokenizer, ids) -> list[str]:
    det = IncrementalDetokenizer(tokenizer)
    return [det.push(t) for t in ids] + [det.flush()]


def cases(tokenizer, seed: int = 0):
    """Token lists of the texts, whole, cut at random, and with random ids (special tokens too) inserted."""
    rng = random.Random(seed)
    for text in TEXTS:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        yield ids
        yield ids[rng.randrange(len(ids)):]
        noisy = list(ids)
        for _ in range(4):
            noisy.insert(rng.randrange(len(noisy) + 1), rng.randrange(len(tokenizer)))
        yield noisy


def test_streamed_text_is_the_decode_of_the_whole_reply(bpe):
    """In the backend's stream (a plain fast tokenizer) and in the window (a tokenizer that cleans
    up spaces is decoded by transformers)."""
    from transformers import PreTrainedTokenizerFast

    cleaning = PreTrainedTokenizerFast(tokenizer_object=bpe.backend_tokenizer, clean_up_tokenization_spaces=True)
    for tokenizer in (bpe, cleaning):
        for ids in cases(tokenizer):
            assert "".join(streamed(tokenizer, ids)) == tokenizer.decode(ids, skip_special_tokens=True)


def test_incomplete_utf8_is_held_back_and_flushed_at_the_end(bpe):
    text = "né€ and 😀"
    pieces = streamed(ByteTokenizer(), list(text.encode()))
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
    assert pieces[1] == "" and pieces[2] == "é"  # the first byte of é alone is held back
    assert streamed(ByteTokenizer(), list("é".encode())[:1]) == ["", "\ufffd"]  # the end shows it as U+FFFD
    lead = next(i for i in range(len(bpe)) if bpe.decode([i]) == "\ufffd")  # a lone byte of a longer character
    ids = list(bpe("hi", add_special_tokens=False)["input_ids"]) + [lead]
    pieces = streamed(bpe, ids)
    assert pieces[-2] == "" and pieces[-1] == "\ufffd" and "".join(pieces) == bpe.decode(ids)


def test_a_decoder_that_rewrites_shown_text_does_not_stop_the_stream():
    """The backend's stream refuses a token whose text no longer starts with what was shown; the
    window takes over and what was shown stays shown."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "<unk>": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])  # "ab" becomes "X"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    assert streamed(fast, [0, 1, 2, 2]) == ["a", "", "c", "c", ""]


def test_generation_takes_a_steps_batch_of_tokens():
    """A step may answer several tokens: all are yielded in order, and the reply still ends at
    ``max_new_tokens`` or at an end-of-reply token inside a batch."""
    script = list("hello wörld, again".encode())

    def run(max_new: int, eos: set[int]) -> tuple[list[int], str, int]:
        pipeline = InstantPipeline(script, 64, 256, per_tick=4, batch=True)
        gen = Generation(pipeline, [1, 2], GenerationParams(max_new_tokens=max_new), eos, ByteTokenizer())

        async def drain():
            async for _ in gen:
                pass

        asyncio.run(drain())
        return gen.result.tokens, gen.result.text, pipeline.steps

    tokens, text, steps = run(10, set())
    assert tokens == script[:10] and text == bytes(script[:10]).decode() and steps == 12  # 3 batches of 4
    tokens, text, _ = run(16, {ord(",")})
    assert tokens == script[:script.index(ord(",")) + 1] and text == "hello wörld"  # the end token counts
