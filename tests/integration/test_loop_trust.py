"""A peer cannot tell a checked session from an unchecked one on the peer-driven path.

Real peer processes on loopback, no control plane: two honest peers holding all 8 layers of
the tiny Llama, and a dishonest one (``tests/dishonest.py``) that corrupts tokens only in the
sessions that loop on it (the peer-driven path, which before verification covered it was used
only by clients that checked nothing). A verifying client (share 0.25, ``verify_hold``) runs
its requests through the same loop as any client, so the dishonest peer corrupts its sessions
too: it is caught, banned, and every request from the one in which it was caught on is
token-identical to ``generate``.
"""

from __future__ import annotations

import asyncio

import pytest

from p2pserve.client.api import AsyncClient
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.config import ClientConfig
from p2pserve.launch import start_peers
from tests import dishonest
from tests.harness import reference_generate

pytestmark = pytest.mark.integration

PROMPTS = [[1, 5, 9, 13], [2, 4, 8, 16, 32], [3, 7, 11]]
NEW_TOKENS = 12
MAX_REQUESTS = 30


@pytest.fixture(scope="module")
def swarm(model_dir):
    path = model_dir("llama")
    peers = start_peers(path, [(0, 8), (0, 8)])
    bad = dishonest.launch(path, (0, 8), 0.3, seed=3, looped_only=True).wait_ready()
    yield path, [(p.maddrs[0], *p.layers) for p in peers + [bad]], bad
    bad.kill()
    for p in peers:
        p.kill()


def test_a_peer_corrupting_only_sessions_it_believes_unchecked_is_caught(swarm):
    path, entries, bad = swarm
    refs = [reference_generate(path, p, NEW_TOKENS) for p in PROMPTS]
    config = ClientConfig(verify_share=0.25, verify_hold=True, hop_timeout_s=30.0, max_retries=3)
    assert config.push.loop  # the default path: a peer holding every layer loops, checked or not

    async def main():
        async with AsyncClient(peers=entries, model=path, config=config, seed=7,
                               model_info=LocalModelInfo.load(path)) as client:
            log = []
            for i in range(MAX_REQUESTS):
                reply = await client.generate(PROMPTS[i % len(PROMPTS)], max_new_tokens=NEW_TOKENS, ignore_eos=True)
                caught = bad.peer_id in client.verifier.excluded
                log.append((i, reply.tokens == refs[i % len(PROMPTS)], caught))
                if caught and len([x for x in log if x[2]]) >= 3:
                    break
            return log, client.verifier.stats

    log, stats = asyncio.run(main())
    print(f"requests: {log}; {stats}")
    first = next((i for i, _, caught in log if caught), None)
    assert first is not None, f"not caught in {MAX_REQUESTS} requests: {stats}"
    assert stats.mismatches >= 1
    assert all(same for i, same, _ in log if i >= first), log
