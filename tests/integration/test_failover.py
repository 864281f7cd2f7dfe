"""Failover with real peer processes: kill peers mid-generation, the output does not change.

Peers on the tiny Llama hold one half each ([0:4) or [4:8)), with two or three replicas. Routes come from
``PeerListRoutes`` over the known peers (no control plane needed). A peer is SIGKILLed from inside
the generation loop, right after a given number of tokens arrived, so the next step finds it
dead and the pipeline must ban it, re-route and replay.
"""

from __future__ import annotations

import asyncio

import pytest

from p2pserve.client.generation import Generation
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.client.params import GenerationParams
from p2pserve.errors import GenerationFailedError
from tests.harness import PeerProcess, client_node, reference_generate, start_peers
from tests.support.swarm import CONFIG, pipeline_over

pytestmark = pytest.mark.integration

# Three replicas of each half: the four tests together kill six peers, and in this order no
# restart is needed (restarts cost ~15-30 s each on the shared two-core machine).
RANGES = [(0, 4), (0, 4), (0, 4), (4, 8), (4, 8), (4, 8)]
GREEDY = GenerationParams(max_new_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(model_dir):
    """The model path and a mutable list of peers; tests replace the ones they killed."""
    path = model_dir("llama")
    peers = start_peers(path, RANGES)
    yield path, peers
    for p in peers:
        p.stop()


def live(peers):
    return [p for p in peers if p.proc.poll() is None]


def ensure(cluster, first: int, second: int):
    """Live peers with at least ``first`` replicas of [0:4) and ``second`` of [4:8).

    Dead peers are restarted (new ids) only when a half has fewer live replicas than the test
    needs, so the tests run in file order without restarts but also pass on their own.
    """
    path, peers = cluster
    restart = []
    for span, need in (((0, 4), first), ((4, 8), second)):
        alive = sum(1 for p in live(peers) if p.layers == span)
        dead = [i for i, p in enumerate(peers) if p.layers == span and p.proc.poll() is not None]
        restart += dead[: max(0, need - alive)]
    if restart:
        fresh = start_peers(path, [RANGES[i] for i in restart])
        for i, p in zip(restart, fresh):
            peers[i] = p
    return path, live(peers)


async def generate_with_kills(path, peers: list[PeerProcess], prompt_ids, params, kills: dict[int, str], seed=0):
    """Generate through a Pipeline; after ``n`` tokens kill the route's hop ``kills[n]``.

    ``kills[n]`` is "first" or "last": which hop of the *current* route to kill.
    Returns (tokens, pipeline).
    """
    model = LocalModelInfo.load(path)
    by_id = {p.peer_id: p for p in peers}
    async with client_node(CONFIG) as transport:
        pipeline = pipeline_over(transport, model, peers, params, seed)
        gen = Generation(pipeline, prompt_ids, params, model.eos_ids)
        try:
            n = 0
            async for _ in gen:
                n += 1
                if n in kills:
                    hop = pipeline.route[0 if kills[n] == "first" else -1]
                    await asyncio.to_thread(by_id[hop.peer_id].kill)
            return gen.result.tokens, pipeline
        finally:
            await pipeline.close()


def prompt(path, text="Tell me about peer-to-peer networks."):
    return LocalModelInfo.load(path).chat_ids([{"role": "user", "content": text}])


def test_kill_two_of_four_peers_one_after_another(cluster):
    path, procs = ensure(cluster, 2, 2)
    # the client knows exactly four peers, two per half: after two kills one route is left
    procs = [p for p in procs if p.layers == (0, 4)][:2] + [p for p in procs if p.layers == (4, 8)][:2]
    ids = prompt(path, "Two failures in a row should not change a single token.")
    ref = reference_generate(path, ids, GREEDY.max_new_tokens)
    tokens, pipeline = asyncio.run(generate_with_kills(path, procs, ids, GREEDY, {5: "first", 12: "last"}))
    assert tokens == ref
    assert len(pipeline.failures) == 2 and len(pipeline.route_log) == 3
    survivors = {h.peer_id for h in pipeline.route}
    assert not survivors & {f.hop.peer_id for f in pipeline.failures}


def test_kill_a_peer_mid_generation_greedy_identical(cluster):
    path, procs = ensure(cluster, 1, 2)
    ids = prompt(path)
    ref = reference_generate(path, ids, GREEDY.max_new_tokens)
    tokens, pipeline = asyncio.run(generate_with_kills(path, procs, ids, GREEDY, {8: "last"}))
    assert tokens == ref
    assert len(pipeline.failures) == 1
    assert len(pipeline.route_log) == 2 and pipeline.route_log[0][-1].peer_id != pipeline.route_log[1][-1].peer_id


def test_sampled_output_with_failure_equals_run_without(cluster):
    path, procs = ensure(cluster, 2, 1)
    ids = prompt(path, "Sample something.")
    params = GenerationParams(max_new_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    clean, s1 = asyncio.run(generate_with_kills(path, procs, ids, params, {}))
    assert not s1.failures
    failed, s2 = asyncio.run(generate_with_kills(path, procs, ids, params, {6: "first"}))
    assert len(s2.failures) == 1
    assert failed == clean


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
                                           "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "ok", "n"], "additionalProperties": False}


async def generate_extras_with_kills(path, peers, prompt_ids, params, kills: dict[int, str]):
    """As :func:`generate_with_kills`, on a pipeline whose last hop gets each step's context and
    grammar mask (``Pipeline.extras``: penalties, structured output)."""
    from p2pserve.client.failover import FailoverState
    from p2pserve.client.pipeline import Pipeline
    from p2pserve.client.route_providers import PeerListRoutes

    model = LocalModelInfo.load(path)
    spec = model.spec
    by_id = {p.peer_id: p for p in peers}
    async with client_node(CONFIG) as transport:
        pipeline = Pipeline(transport, PeerListRoutes(spec.num_layers, [p.hop() for p in peers], seed=0), spec.model_id,
                            spec.num_layers, 256, params.validate(), CONFIG, FailoverState(CONFIG),
                            vocab_size=spec.vocab_size, extras=True)
        gen = Generation(pipeline, prompt_ids, params, model.eos_ids, model.tokenizer)
        try:
            n = 0
            async for _ in gen:
                n += 1
                if n in kills:
                    hop = pipeline.route[0 if kills[n] == "first" else -1]
                    await asyncio.to_thread(by_id[hop.peer_id].kill)
            return gen.result, pipeline
        finally:
            await pipeline.close()


def test_penalties_and_a_json_schema_with_failure_equal_the_run_without(cluster):
    """Sampled with presence, frequency and repetition penalties under a ``json_schema`` grammar:
    the replay after a SIGKILL gives the new last hop the whole token history (the penalties'
    counts) and the grammar's state goes on, so the reply is the same as without a failure."""
    import json

    import jsonschema

    from p2pserve.client.grammar import compiler_for

    path, procs = ensure(cluster, 2, 1)
    model = LocalModelInfo.load(path)
    ids = prompt(path, "Answer in JSON.")
    grammar = compiler_for(model.tokenizer, model.spec.vocab_size, model.eos_ids).json_schema(SCHEMA)
    params = GenerationParams(max_new_tokens=40, temperature=0.9, seed=77, presence_penalty=0.6,
                              frequency_penalty=0.4, repetition_penalty=1.3).with_sampling(grammar=grammar)
    clean, s1 = asyncio.run(generate_extras_with_kills(path, procs, ids, params, {}))
    assert not s1.failures
    failed, s2 = asyncio.run(generate_extras_with_kills(path, procs, ids, params, {6: "first"}))
    assert len(s2.failures) == 1
    assert failed.tokens == clean.tokens and len(clean.tokens) > 6
    if clean.finish_reason == "stop":
        jsonschema.validate(json.loads(clean.text), SCHEMA)


def test_kill_every_replica_of_a_layer_fails_clearly(cluster):
    path, procs = ensure(cluster, 1, 1)
    ids = prompt(path)
    second_half = [p for p in procs if p.layers == (4, 8)]

    # both [4:8) replicas die after the 3rd token: nothing can serve layers 4..7 any more
    with pytest.raises(GenerationFailedError) as e:
        asyncio.run(generate_with_kills_all(path, procs, ids, second_half))
    text = str(e.value)
    assert "no usable peer serves layer 4" in text
    # every failed hop is named: both replicas of [4:8) (the second was tried after the first)
    assert all(p.peer_id in text for p in second_half), text
    assert text.count("banned") <= CONFIG.max_retries + 1


async def generate_with_kills_all(path, procs, ids, victims):
    """Generate greedily and kill every peer in ``victims`` after 3 tokens."""
    model = LocalModelInfo.load(path)
    async with client_node(CONFIG) as transport:
        pipeline = pipeline_over(transport, model, procs, GREEDY)
        try:
            n = 0
            async for _ in Generation(pipeline, ids, GREEDY, model.eos_ids):
                n += 1
                if n == 3:
                    for p in victims:
                        await asyncio.to_thread(p.kill)
        finally:
            await pipeline.close()
