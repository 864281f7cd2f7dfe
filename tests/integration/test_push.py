"""Push mode with real peer processes: steps forwarded peer to peer over libp2p / the direct path.

Four `p2pserve peer` processes on the tiny Llama: [0:3), [3:6) and two replicas of [6:8), each
behind a delay relay adding 25 ms each way (``p2pserve/testing/wan.py``), so every link, client to
peer and peer to peer, is a slow one. The client opens a session on each hop of a 3-hop route, allows each hop's predecessor into it, and
sends each step to the first hop only; the peers forward hidden states to each other and the last
hop's token comes back along the chain. Greedy output must equal `generate`, also when the
route's last peer is SIGKILLed mid-generation: its predecessor reports it unreachable, the client
bans it, re-routes to the replica and replays. The route is pushed by the rule itself
(``PushConfig(enabled=True)``: the sessions' open round trips are over its 40 ms).
"""

from __future__ import annotations

import asyncio

import pytest

from p2pserve.client.failover import FailoverState
from p2pserve.client.generation import Generation
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.client.params import GenerationParams
from p2pserve.client.pipeline import Pipeline
from p2pserve.client.push import PushConfig
from p2pserve.client.route_providers import ChainListRoutes
from p2pserve.config import ClientConfig
from p2pserve.testing.wan import start_relayed_peers, stop_relayed_peers
from tests.harness import client_node, reference_generate

pytestmark = pytest.mark.integration

RANGES = [(0, 3), (3, 6), (6, 8), (6, 8)]
CONFIG = ClientConfig(hop_timeout_s=60.0, max_retries=3, ban_base_s=30.0)
GREEDY = GenerationParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    path = model_dir("llama")
    relayed = start_relayed_peers(path, RANGES, delay_ms=25.0, workdir=tmp_path_factory.mktemp("push"))
    yield path, [rp.peer for rp in relayed]
    stop_relayed_peers(relayed)


async def _generate(path, peers, prompt_ids, kill_after: int | None = None):
    """Pushed greedy generation over the chains [A, B, C] then [A, B, C2]; kills C after
    ``kill_after`` tokens. Returns (tokens, pipeline)."""
    model = LocalModelInfo.load(path)
    a, b, c, c2 = peers
    routes = ChainListRoutes([[a.hop(), b.hop(), c.hop()], [a.hop(), b.hop(), c2.hop()]])
    async with client_node(CONFIG) as transport:
        pipeline = Pipeline(transport, routes, model.spec.model_id, model.spec.num_layers, 256, GREEDY.validate(),
                            CONFIG, FailoverState(CONFIG), vocab_size=model.spec.vocab_size)
        pipeline.push = PushConfig(enabled=True)  # pushed because the links are slow (the rule)
        gen = Generation(pipeline, prompt_ids, GREEDY, model.eos_ids)
        try:
            n = 0
            async for _ in gen:
                n += 1
                if n == kill_after:
                    await asyncio.to_thread(c.kill)
            return gen.result.tokens, pipeline
        finally:
            await pipeline.close()


def _prompt(path, text):
    return LocalModelInfo.load(path).chat_ids([{"role": "user", "content": text}])


def test_pushed_greedy_output_is_token_identical(cluster):
    path, peers = cluster
    ids = _prompt(path, "Forward it peer to peer, please.")
    tokens, pipeline = asyncio.run(_generate(path, peers, ids))
    assert tokens == reference_generate(path, ids, GREEDY.max_new_tokens)
    assert not pipeline.failures and len(pipeline.route_log) == 1
    assert pipeline.pushed_steps == GREEDY.max_new_tokens  # the rule chose push for every step


def test_a_peer_killed_mid_generation_is_reported_and_routed_around(cluster):
    path, peers = cluster
    ids = _prompt(path, "Even when a peer dies on the way.")
    tokens, pipeline = asyncio.run(_generate(path, peers, ids, kill_after=5))
    assert tokens == reference_generate(path, ids, GREEDY.max_new_tokens)
    # B could not reach the dead last hop and said so: the client banned C (not A or B) and re-routed
    assert [f.hop.peer_id for f in pipeline.failures] == [peers[2].peer_id]
    assert pipeline.route[-1].peer_id == peers[3].peer_id
