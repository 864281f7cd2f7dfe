"""Whole-cluster behaviour: a hand-computed 2-node case and conservation of requests."""

import random

import pytest

from p2pserve.sim.batching import BatchCaps, ThrottlePolicy
from p2pserve.sim.kv import KvSettings
from p2pserve.sim.request import Query

from tests.support.sim import make_sim, make_topology


def test_two_nodes_hand_computed():
    # 2 layers: node 0 runs layer 0, node 1 runs layer 1. Links: 1 ms + bytes / 1e5 B/s.
    # Token ids are 2 B, activations 100 B per token. Prompt: 1 ms/token/layer. Decode: 1 ms
    # per layer, doubled for a lone token.
    topo = make_topology([(0, 1), (1, 2)], num_layers=2)
    sim = make_sim(topo)
    q = Query(0, input_len=10, output_len=2, arrival=0.0)
    sim.loop.at(0.0, lambda _: sim.submit(q))
    sim.loop.run(10.0)

    t = 0.001 + 10 * 2 / 1e5  # source -> node 0: 10 token ids
    t += 0.010  # layer 0 prefill of 10 tokens
    t += 0.001 + 10 * 100 / 1e5  # node 0 -> node 1: 10 activations
    t += 0.010  # layer 1
    t += 0.001 + 2 / 1e5  # node 1 -> sink: one token id
    prompt_done = t
    step = (0.001 + 2 / 1e5) + 0.002 + (0.001 + 100 / 1e5) + 0.002 + (0.001 + 2 / 1e5)

    assert q.prompt_done == pytest.approx(prompt_done, abs=1e-12)
    assert q.finished == pytest.approx(prompt_done + 2 * step, abs=1e-12)
    rec = sim.recorder
    assert rec.prompt_lat == [pytest.approx(prompt_done, abs=1e-12)]
    assert rec.decode_lat == [pytest.approx(step, abs=1e-12)] * 2
    assert rec.decode_tokens == 2 and rec.finished == 1
    assert sim.kv.active_tokens == 0 and all(v == 0 for v in sim.kv.reserved.values())


def test_batching_joins_jobs_that_arrived_meanwhile_and_doubles_single_decode():
    # Two prompts arrive 0.5 ms apart at a one-layer node: the second waits for the first batch
    # (dynamic batching never waits on purpose), then runs alone.
    topo = make_topology([(0, 1)], num_layers=1, bandwidth=1e12, latency=0.0)
    sim = make_sim(topo)
    a, b = Query(0, 100, 0, 0.0), Query(1, 100, 0, 0.0005)
    sim.loop.at(0.0, lambda _: sim.submit(a))
    sim.loop.at(0.0005, lambda _: sim.submit(b))
    sim.loop.run(1.0)
    assert a.prompt_done == pytest.approx(0.100, abs=1e-9)
    assert b.prompt_done == pytest.approx(0.200, abs=1e-9)


def test_prompt_cap_splits_batches():
    caps = BatchCaps(prompt_max_requests=1, prompt_max_tokens=2048, decode_max_tokens=64)
    topo = make_topology([(0, 1)], num_layers=1, bandwidth=1e12, latency=0.0, caps=caps)
    sim = make_sim(topo)
    qs = [Query(i, 10, 0, 0.0) for i in range(3)]
    sim.loop.at(0.0, lambda _: [sim.submit(q) for q in qs])
    sim.loop.run(1.0)
    assert [round(q.prompt_done, 9) for q in qs] == [0.01, 0.02, 0.03]


@pytest.mark.parametrize("chunked", [False, True])
def test_chunked_prefill_lets_a_decode_pass_a_long_prompt(chunked):
    """A 4-token query is about to decode when a 100-token prompt arrives at a one-layer node (1 ms
    per prompt token, 1 ms per decode token doubled when alone). Atomic prompts make the first
    decode step wait out the whole prefill (102 ms); chunked prefill (gLLM budget: max(waiting /
    8, 32) tokens) runs it in 32-token pieces next to the decode (66 ms), and the node does the
    same 108 ms of work either way."""
    topo = make_topology([(0, 1)], num_layers=1, bandwidth=1e12, latency=0.0)
    sim = make_sim(topo, batch_policy=ThrottlePolicy(chunk_prefill=chunked))
    short, long = Query(0, 4, 2, 0.0), Query(1, 100, 0, 0.001)
    sim.loop.at(0.0, lambda _: sim.submit(short))
    sim.loop.at(0.001, lambda _: sim.submit(long))
    sim.loop.run(1.0)
    assert short.prompt_done == pytest.approx(0.004, abs=1e-9)
    steps = sim.recorder.decode_lat  # each decode step's time from leaving the client to its token
    if chunked:
        # 4 ms: a 32-token chunk (the decode is not back yet); 36 ms: chunk + decode (34 ms); 70 ms:
        # a chunk; 102 ms: the last 4 prompt tokens + the second decode (6 ms)
        assert steps == [pytest.approx(0.066, abs=1e-9), pytest.approx(0.038, abs=1e-9)]
        assert long.prompt_done == pytest.approx(0.108, abs=1e-9)
    else:
        # 4 ms: the whole prompt (100 ms); then the two decodes alone (2 ms each)
        assert steps == [pytest.approx(0.102, abs=1e-9), pytest.approx(0.002, abs=1e-9)]
        assert long.prompt_done == pytest.approx(0.104, abs=1e-9)
    node = sim.nodes[0]
    assert node.busy_time == pytest.approx(0.004 + 0.100 + 0.004, abs=1e-9)  # same work either way
    assert not any(node.pq) and long.chunk_done == 0


@pytest.mark.parametrize("scheduler", ["iwrr", "random", "shortest-queue", "swarm", "petals"])
@pytest.mark.parametrize("throttle", [False, True, "chunked"])
@pytest.mark.parametrize("kv_model", ["reserve", "vllm"])
def test_every_query_finishes_once_with_all_its_tokens(scheduler, throttle, kv_model):
    # Overlapping ranges (partial inference), tight KV so that queries wait, mixed lengths.
    ranges = [(0, 3), (0, 2), (2, 5), (3, 6), (5, 8), (4, 8)]
    topo = make_topology(ranges, num_layers=8, kv_capacity=40_000)
    sim = make_sim(topo, scheduler=scheduler, kv_settings=KvSettings(hwm=0.9, output_ratio=0.6, avg_output=20),
                   batch_policy=ThrottlePolicy(chunk_prefill=throttle == "chunked") if throttle else None,
                   kv_model=kv_model,
                   kv_mask=scheduler == "iwrr")
    rng = random.Random(7)
    queries = [Query(i, rng.randint(1, 300), rng.randint(0, 40), rng.uniform(0, 2.0)) for i in range(200)]
    for q in queries:
        sim.loop.at(q.arrival, sim.submit, q)
    finished = []
    sim.hooks.done.append(finished.append)
    sim.loop.run(float("inf"))
    assert sorted(q.qid for q in finished) == list(range(200))  # each exactly once
    assert sim.recorder.decode_tokens == sum(q.output_len for q in queries)
    assert all(q.decoded == q.output_len for q in queries)
    assert not sim.pending
    assert sim.kv.active_tokens == 0
    for node in sim.nodes.values():
        assert node.kv_used == 0 and not node.kv_wait and node.queued_tokens == 0 and not node.kv_held
        assert not any(node.pq) and not any(node.dq)
    for link in sim.links.values():
        assert not link.busy and link.queued() == 0
    for q in queries:  # routes cover every layer exactly once, in order
        layers = [l for st in q.route for l in range(st.start, st.end)]
        assert layers == list(range(8))


def test_node_kv_gate_makes_a_prompt_wait_for_space():
    # One node, capacity for one query's footprint: (input + output) * layers = (100 + 5) * 1.
    topo = make_topology([(0, 1)], num_layers=1, bandwidth=1e12, latency=0.0, kv_capacity=150)
    sim = make_sim(topo, kv_mask=False)  # no routing mask: the node's own gate must hold
    a, b = Query(0, 100, 5, 0.0), Query(1, 100, 5, 0.0)
    sim.loop.at(0.0, lambda _: (sim.submit(a), sim.submit(b)))
    sim.loop.run(10.0)
    assert sim.nodes[0].kv_waits == 1
    # b's prefill starts only when a has finished: a = 0.1 s prefill + 5 decodes of 2 ms
    assert a.finished == pytest.approx(0.110, abs=1e-9)
    assert b.prompt_done == pytest.approx(a.finished + 0.100, abs=1e-9)
    assert sim.nodes[0].kv_used == 0


def test_kv_estimate_mask_queues_queries_until_one_finishes():
    # Estimate per query: (input + avg_output * ratio) * layers = (100 + 10) * 1 = 110; hwm 0.5
    # of 300 admits one query at a time.
    topo = make_topology([(0, 1)], num_layers=1, bandwidth=1e12, latency=0.0, kv_capacity=300)
    sim = make_sim(topo, kv_settings=KvSettings(hwm=0.5, output_ratio=1.0, avg_output=10))
    a, b = Query(0, 100, 3, 0.0), Query(1, 100, 3, 0.0)
    sim.loop.at(0.0, lambda _: (sim.submit(a), sim.submit(b)))
    sim.loop.run(0.001)
    assert len(sim.pending) == 1 and sim.kv.reserved[0] == 110
    sim.loop.run(10.0)
    assert not sim.pending and b.prompt_done > a.finished


def test_vllm_kv_model_preempts_and_recomputes_without_losing_tokens():
    # Two sessions share a node whose KV holds both prompts but not their growth: the later one
    # is preempted, recomputes its context, and every token still arrives exactly once.
    topo = make_topology([(0, 1)], num_layers=1, bandwidth=1e12, latency=0.0, kv_capacity=210)
    sim = make_sim(topo, scheduler="random", kv_mask=False, kv_model="vllm")
    a, b = Query(0, 100, 20, 0.0), Query(1, 100, 20, 0.0)
    sim.loop.at(0.0, lambda _: (sim.submit(a), sim.submit(b)))
    sim.loop.run(100.0)
    node = sim.nodes[0]
    assert node.preemptions >= 1 and node.recomputes >= 1
    assert a.decoded == 20 and b.decoded == 20 and a.finished > 0 and b.finished > 0
    assert sim.recorder.decode_tokens == 40
    assert node.kv_used == 0 and not node.kv_held and not node.kv_wait
