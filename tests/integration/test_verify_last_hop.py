"""A last hop that returns wrong tokens is caught by one batched replay and the request rolled back.

Real peer processes on loopback, no control plane (a client over a fixed list of peers): an
honest [0, 4), two honest [4, 8) and a dishonest [4, 8) (``tests/dishonest.py``)
that returns another token on 30% of its steps. The client verifies at share 0.25 with
``verify_hold``: a drawn last hop is checked when its route is done by one Forward of the
whole history that asks the witness for the token after each of the last positions, so every
token the hop returned there is compared. Asserted: the dishonest peer is banned, and the
request in which it was caught and every one after are token-identical to ``generate``.

The second test drafts with prompt lookup (docs/speculative.md) on a prompt that repeats itself,
so most last-hop steps verify several drafts at once and the dishonest peer changes one of the
tokens such a step returns: the check replays those steps too, and the same holds.
"""

from __future__ import annotations

import asyncio

import pytest

from p2pserve.client.api import AsyncClient
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.config import SpeculativeConfig
from p2pserve.config import ClientConfig
from p2pserve.launch import start_peers
from tests import dishonest
from tests.harness import reference_generate

pytestmark = pytest.mark.integration

PROMPTS = [[1, 5, 9, 13], [2, 4, 8, 16, 32], [3, 7, 11]]
NEW_TOKENS = 16
MAX_REQUESTS = 40


@pytest.fixture(scope="module")
def swarm(model_dir):
    """Honest [0, 4), two honest [4, 8) and one that returns another token on 30% of its steps."""
    path = model_dir("llama")
    peers = start_peers(path, [(0, 4), (4, 8), (4, 8)])
    bad = dishonest.launch(path, (4, 8), 0.3, seed=5).wait_ready()
    yield path, [(p.maddrs[0], *p.layers) for p in peers + [bad]], bad
    bad.kill()
    for p in peers:
        p.kill()


def _until_caught(path, entries, bad, prompts, refs, **client_kw):
    """Requests in turn until the client has banned ``bad`` and made 5 more: (index, identical,
    tokens rolled back, caught yet) for each, and the verifier's stats."""
    model = LocalModelInfo.load(path)
    config = ClientConfig(verify_share=0.25, verify_hold=True, hop_timeout_s=30.0, max_retries=3)

    async def main():
        async with AsyncClient(peers=entries, model=path, config=config, seed=11, model_info=model,
                               **client_kw) as client:
            log = []
            for i in range(MAX_REQUESTS):
                reply = await client.generate(prompts[i % len(prompts)], max_new_tokens=NEW_TOKENS, ignore_eos=True)
                caught = bad.peer_id in client.verifier.excluded
                log.append((i, reply.tokens == refs[i % len(prompts)], reply.rolled_back, caught))
                if caught and len([x for x in log if x[3]]) >= 5:
                    break
            return log, client.verifier.stats

    return asyncio.run(main())


def test_a_corrupting_last_hop_is_caught_and_its_request_regenerated(swarm):
    path, entries, bad = swarm
    refs = [reference_generate(path, p, NEW_TOKENS) for p in PROMPTS]
    log, stats = _until_caught(path, entries, bad, PROMPTS, refs)
    print(f"requests: {[(i, same, n) for i, same, n, _ in log]}; {stats}")
    first = next((i for i, _, _, caught in log if caught), None)
    assert first is not None, f"not caught in {MAX_REQUESTS} requests: {stats}"
    assert stats.mismatches >= 1 and stats.verified > stats.sampled  # one replay compared several tokens
    assert all(same for i, same, _, _ in log if i >= first), log


def test_corrupted_speculative_steps_are_checked_and_caught(swarm):
    path, entries, bad = swarm
    prompts = [[5, 9, 13, 21] * 4, [2, 4, 8, 16, 32] * 3]  # repeated n-grams: prompt lookup drafts
    refs = [reference_generate(path, p, NEW_TOKENS) for p in prompts]
    log, stats = _until_caught(path, entries, bad, prompts, refs, speculative="prompt-lookup",
                               speculative_config=SpeculativeConfig(max_k=4, adaptive=False))
    print(f"requests: {[(i, same, n) for i, same, n, _ in log]}; {stats}")
    first = next((i for i, _, _, caught in log if caught), None)
    assert first is not None, f"not caught in {MAX_REQUESTS} requests: {stats}"
    assert stats.verified_speculative > 0 and stats.mismatches >= 1
    assert all(same for i, same, _, _ in log if i >= first), log
