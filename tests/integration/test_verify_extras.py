"""A last hop that corrupts only requests with penalties or a grammar is caught too.

Real peer processes on loopback, no control plane: an honest [0, 4), two honest [4, 8) and a
dishonest [4, 8) (``tests/dishonest.py``) that returns another token on half of the steps it was
sent a token history for (``Forward.context``: penalties, structured output) and serves plain
requests honestly. Its claims bind the penalties, the history and the grammar's mask
(``ReplyClaim.extras``), so the client's witness replays the hop's steps as it got them, each
with its own context and mask. Asserted: the honest peers' signatures on such steps verify, the
dishonest peer is banned, and the requests from the one it was caught in on equal those of a
client that never met it.
"""

from __future__ import annotations

import asyncio

import pytest

from p2pserve.client.api import AsyncClient
from p2pserve.client.grammar import compiler_for
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.client.params import GenerationParams
from p2pserve.config import ClientConfig
from p2pserve.launch import start_peers
from tests import dishonest

pytestmark = pytest.mark.integration

PROMPTS = [[1, 5, 9, 13], [2, 4, 8, 16, 32], [3, 7, 11]]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0}},
          "required": ["ok", "n"], "additionalProperties": False}
MAX_REQUESTS = 30


@pytest.fixture(scope="module")
def swarm(model_dir):
    path = model_dir("llama")
    peers = start_peers(path, [(0, 4), (4, 8), (4, 8)])
    bad = dishonest.launch(path, (4, 8), 0.5, seed=3, only_extras=True).wait_ready()
    honest = [(p.maddrs[0], *p.layers) for p in peers]
    yield path, honest, honest + [(bad.maddrs[0], *bad.layers)], bad
    bad.kill()
    for p in peers:
        p.kill()


def _params(model, i: int) -> GenerationParams:
    """Penalties on every request, a JSON schema on every other one (greedy: one right answer)."""
    params = GenerationParams(max_new_tokens=10, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2)
    if i % 2:
        grammar = compiler_for(model.tokenizer, model.spec.vocab_size, model.eos_ids).json_schema(SCHEMA)
        params = params.with_sampling(grammar=grammar)
    return params


def _run(path, entries, requests: int, bad=None):
    model = LocalModelInfo.load(path)
    config = ClientConfig(verify_share=0.3 if bad else 0.0, verify_hold=True, hop_timeout_s=30.0, max_retries=3)

    async def main():
        async with AsyncClient(peers=entries, model=path, config=config, seed=11, model_info=model) as client:
            log = []
            for i in range(requests):
                reply = await client.generate(PROMPTS[i % len(PROMPTS)], params=_params(model, i))
                log.append((reply.tokens, bad is not None and bad.peer_id in client.verifier.excluded))
                if log[-1][1] and sum(caught for _, caught in log) >= 3:
                    break
            return log, client.verifier.stats if client.verifier else None

    return asyncio.run(main())


def test_a_last_hop_corrupting_only_penalty_and_grammar_requests_is_caught(swarm):
    path, honest, entries, bad = swarm
    log, stats = _run(path, entries, MAX_REQUESTS, bad)
    refs, _ = _run(path, honest, len(log))
    first = next((i for i, (_, caught) in enumerate(log) if caught), None)
    assert first is not None, f"not caught in {MAX_REQUESTS} requests: {stats}"
    assert stats.mismatches >= 1 and stats.bad_signatures == 0, stats
    assert [t for t, _ in log[first:]] == [t for t, _ in refs[first:]]
