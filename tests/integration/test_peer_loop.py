"""Peer-driven decode on a peer holding every layer: the ring of one hop, with real processes.

Two ``p2pserve peer`` processes on the tiny Llama each hold all 8 layers. The client pushes a
request's first step with a ring grant naming the peer as its own successor; from then on the
peer samples each token and runs the next step itself, with no network per token, and the
client only reads the tokens (``client/ring.py``, ``peer/forwarding.py``). Greedy output must
equal ``generate``: alone, for several sessions stepping together in one batch, after the
client cut a ring that had run ahead of it (its positions are rewound), and when the peer is
SIGKILLed mid-stream (the client bans it, re-routes to the other and replays).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from p2pserve.client.connection import HopConnection
from p2pserve.client.failover import FailoverState
from p2pserve.client.generation import Generation
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.client.params import GenerationParams
from p2pserve.client.pipeline import Pipeline
from p2pserve.client.route_providers import ChainListRoutes
from p2pserve.config import ClientConfig, PushConfig
from tests.harness import client_node, reference_generate, start_peers

pytestmark = pytest.mark.integration

CONFIG = ClientConfig(hop_timeout_s=60.0, max_retries=3, ban_base_s=30.0, verify_share=0.0,
                      push=PushConfig(enabled=True, ring=True, window=8))
GREEDY = GenerationParams(max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(model_dir):
    path = model_dir("llama")
    peers = start_peers(path, [(0, 8), (0, 8)])
    yield path, peers
    for p in peers:
        p.stop()


def _pipeline(transport, path, peers, params):
    model = LocalModelInfo.load(path)
    routes = ChainListRoutes([[p.hop()] for p in peers])
    return Pipeline(transport, routes, model.spec.model_id, model.spec.num_layers, 256, params.validate(), CONFIG,
                    FailoverState(CONFIG), vocab_size=model.spec.vocab_size), model


async def _generate(transport, path, peers, prompt_ids, params=GREEDY, stop_after=None, kill_after=None):
    """Tokens of one generation over ``peers`` (one-hop routes, in order); stops reading after
    ``stop_after`` tokens, or kills the route's peer after ``kill_after``. Returns (tokens, pipeline)."""
    pipeline, model = _pipeline(transport, path, peers, params)
    gen = Generation(pipeline, prompt_ids, params, model.eos_ids)
    try:
        n = 0
        async for _ in gen:
            n += 1
            if n == kill_after:
                await asyncio.to_thread(peers[0].kill)
            if n == stop_after:
                break
        return gen.result.tokens, pipeline
    finally:
        await pipeline.close()


def _prompt(path, text):
    return LocalModelInfo.load(path).chat_ids([{"role": "user", "content": text}])


def test_a_peer_holding_every_layer_loops_on_itself(cluster):
    path, peers = cluster
    ids = _prompt(path, "Loop on yourself, please.")

    async def run():
        async with client_node(CONFIG) as transport:
            return await _generate(transport, path, peers, ids)

    tokens, pipeline = asyncio.run(run())
    assert tokens == reference_generate(path, ids, GREEDY.max_new_tokens)
    assert not pipeline.failures and len(pipeline.route) == 1
    assert pipeline.forwarding.ring_steps == GREEDY.max_new_tokens - 1  # every token after the first looped


def test_sessions_looping_together_step_in_one_batch(cluster):
    path, peers = cluster
    prompts = [_prompt(path, f"Session number {i} of six, step in time.") for i in range(6)]
    # long enough that the sessions loop at the same time even when the client opens them slowly
    params = GenerationParams(max_new_tokens=64, ignore_eos=True)

    async def run():
        async with client_node(CONFIG) as transport:
            results = await asyncio.gather(*(_generate(transport, path, peers[1:], ids, params) for ids in prompts))
            link = HopConnection(transport, peers[1].hop(), CONFIG.frame_limits, 30.0)
            try:
                return results, await link.stats()
            finally:
                await link.close()

    results, stats = asyncio.run(run())
    for ids, (tokens, pipeline) in zip(prompts, results):
        assert tokens == reference_generate(path, ids, params.max_new_tokens)
        assert pipeline.forwarding.ring_steps == params.max_new_tokens - 1
    assert stats.max_batch_sessions > 1  # the looping sessions shared steps


def test_a_ring_cut_ahead_of_the_client_is_rewound(cluster):
    """The client stops reading after 4 tokens while the ring ran up to 8 steps past them; the
    next turn on the same pipeline sends a different token there: the positions the ring
    computed past the cut are dropped, and the output is the reference's for the new prompt."""
    path, peers = cluster
    ids = _prompt(path, "Run ahead, then come back.")
    params = GenerationParams(max_new_tokens=40, ignore_eos=True)

    async def run():
        async with client_node(CONFIG) as transport:
            pipeline, model = _pipeline(transport, path, peers, params)
            try:
                first = Generation(pipeline, ids, params, model.eos_ids)
                got = []
                async for event in first:
                    got.append(event.token)
                    if len(got) == 4:
                        break
                turn = ids + got[:2] + [(got[2] + 1) % model.spec.vocab_size]
                second = Generation(pipeline, turn, GREEDY, model.eos_ids)
                async for _ in second:
                    pass
                return turn, second.result.tokens, pipeline
            finally:
                await pipeline.close()

    turn, tokens, pipeline = asyncio.run(run())
    assert tokens == reference_generate(path, turn, GREEDY.max_new_tokens)
    assert not pipeline.failures


def test_a_peer_killed_mid_loop_is_routed_around(cluster):
    path, peers = cluster
    ids = _prompt(path, "Even when the loop's peer dies.")

    async def run():
        async with client_node(CONFIG) as transport:
            return await _generate(transport, path, peers, ids, kill_after=5)

    tokens, pipeline = asyncio.run(run())
    assert tokens == reference_generate(path, ids, GREEDY.max_new_tokens)
    assert [f.hop.peer_id for f in pipeline.failures] == [peers[0].peer_id]
