"""Speculative decoding through real peer processes: greedy output with each draft equals
single-process `generate`, and seeded sampling equals the non-speculative run and repeats."""

from __future__ import annotations

import asyncio

import pytest

from p2pserve.client.drafts import DraftModel, PromptLookup
from p2pserve.client.generation import generate
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.client.params import GenerationParams
from p2pserve.config import SpeculativeConfig
from tests.harness import client_node, open_chain_pipeline, reference_generate, start_peers

pytestmark = pytest.mark.integration

#: a reply that copies: the prompt repeats a passage, and tiny random models fall into loops
COPY_PROMPT = ("Edit this code: def add(a, b): return a + b. def add(a, b): return a + b. "
               "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.")


@pytest.fixture(scope="module")
def chain(model_dir):
    path = model_dir("llama")
    peers = start_peers(path, [(0, 3), (3, 6), (6, 8)])
    yield path, peers
    for p in peers:
        p.stop()


async def _run(model, hops, ids, params, drafter=None):
    """Tokens of one generation over ``hops`` (speculative when ``drafter`` is given), and the
    tuner's (drafted, accepted) counts."""
    async with client_node() as transport:
        pipeline = await open_chain_pipeline(transport, hops, model, 256, params)
        try:
            from p2pserve.client.generation import Generation

            gen = Generation(pipeline, ids, params, model.eos_ids, drafter=drafter,
                             speculative=SpeculativeConfig(max_k=6, adaptive=False))
            async for _ in gen:
                pass
            tuner = gen.tuner
            return gen.result.tokens, ((tuner.drafted, tuner.accepted) if tuner else (0, 0))
        finally:
            await pipeline.close()


def test_greedy_speculation_with_each_draft_matches_generate(chain, model_dir, tmp_path):
    from p2pserve.model.tiny import build_tiny_model

    path, peers = chain
    model = LocalModelInfo.load(path)
    hops = [p.hop() for p in peers]
    ids = model.chat_ids([{"role": "user", "content": COPY_PROMPT}])
    params = GenerationParams(max_new_tokens=32, ignore_eos=True)
    ref = reference_generate(path, ids, params.max_new_tokens)
    other = build_tiny_model("llama", tmp_path / "draft", seed=1, num_layers=2)  # same tokenizer, other weights
    drafts = {"prompt-lookup": PromptLookup(), "draft:target": DraftModel(path, model.spec.vocab_size, model.tokenizer),
              "draft:other": DraftModel(other, model.spec.vocab_size, model.tokenizer)}
    for name, drafter in drafts.items():
        tokens, (drafted, accepted) = asyncio.run(_run(model, hops, ids, params, drafter))
        assert tokens[: len(ref)] == ref, name
        assert drafted > 0, name
        if name == "draft:target":  # the target drafting for itself: every draft token is accepted
            assert accepted == drafted


def test_seeded_sampling_with_speculation_is_the_plain_run_and_repeats(chain):
    path, peers = chain
    model = LocalModelInfo.load(path)
    hops = [p.hop() for p in peers]
    ids = model.chat_ids([{"role": "user", "content": COPY_PROMPT}])
    params = GenerationParams(max_new_tokens=24, ignore_eos=True, temperature=0.8, seed=11)
    plain, _ = asyncio.run(_run(model, hops, ids, params))
    first, (drafted, _) = asyncio.run(_run(model, hops, ids, params, DraftModel(path, model.spec.vocab_size)))
    again, _ = asyncio.run(_run(model, hops, ids, params, DraftModel(path, model.spec.vocab_size)))
    assert drafted > 0 and first == plain and again == first
