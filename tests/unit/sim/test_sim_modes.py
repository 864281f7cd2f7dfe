"""The simulator's transport modes (push, client-driven), the client's region, and speculation."""

import random

import pytest

from p2pserve.errors import ConfigError
from p2pserve.placement.topology import LinkSpec, NodeSpec, Topology
from p2pserve.sim.graph import Assignment, StageGraph
from p2pserve.sim.kv import KvSettings
from p2pserve.sim.request import Query
from p2pserve.sim.transport import (
    TransportConfig,
    client_graph,
    draw_accepted,
    expected_tokens,
    node_regions,
    relocate_client,
)
from p2pserve.types import SINK_INDEX as SINK
from p2pserve.types import SOURCE_INDEX as SOURCE
from tests.support.sim import CAPS, make_sim, make_topology


def _run_one(graph, transport, input_len=10, output_len=2):
    sim = make_sim(graph, transport=transport)
    q = Query(0, input_len=input_len, output_len=output_len, arrival=0.0)
    sim.loop.at(0.0, lambda _: sim.submit(q))
    sim.loop.run(10.0)
    return sim, q


def test_expected_tokens_and_the_seeded_draw_agree():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    rng = random.Random(1)
    for a, k in ((0.6, 4), (0.9, 8), (0.3, 2)):
        draws = [1 + draw_accepted(rng, a, k) for _ in range(20_000)]
        assert sum(draws) / len(draws) == pytest.approx(expected_tokens(a, k), rel=0.03)
        assert max(draws) <= k + 1
    assert draw_accepted(rng, 1.0, 3) == 3 and draw_accepted(rng, 0.0, 3) == 0 and draw_accepted(rng, 1.0, 0) == 0


def test_transport_config_is_checked():
    for bad in ({"mode": "relay"}, {"spec_k": -1}, {"acceptance": 1.5}, {"client_region": -1}):
        with pytest.raises(ConfigError):
            TransportConfig(**bad)


def test_client_driven_hops_go_through_the_client_hand_computed():
    # 2 layers on 2 nodes, every link 1 ms + bytes / 1e5 B/s; token ids 2 B, activations 100 B.
    graph = make_topology([(0, 1), (1, 2)], num_layers=2)
    _, push = _run_one(graph, TransportConfig(mode="push"))
    sim, q = _run_one(graph, TransportConfig(mode="client"))
    t = 0.001 + 10 * 2 / 1e5  # client -> node 0: 10 token ids
    t += 0.010  # layer 0 prefill
    t += 2 * (0.001 + 10 * 100 / 1e5)  # node 0 -> client -> node 1: 10 activations, twice
    t += 0.010  # layer 1
    t += 0.001 + 2 / 1e5  # node 1 -> client: one token id
    step = (0.001 + 2 / 1e5) + 0.002 + 2 * (0.001 + 100 / 1e5) + 0.002 + (0.001 + 2 / 1e5)
    assert q.prompt_done == pytest.approx(t, abs=1e-12)
    assert q.finished == pytest.approx(t + 2 * step, abs=1e-12)
    assert sim.recorder.decode_tokens == 2
    # push crosses one link per hop boundary where the client drives two: the prompt's 10
    # activations once more, and each decode step's one activation
    extra = (0.001 + 10 * 100 / 1e5) + 2 * (0.001 + 100 / 1e5)
    assert q.finished - push.finished == pytest.approx(extra, abs=1e-12)


def test_speculation_costs_k_plus_one_positions_and_yields_the_accepted_tokens():
    graph = make_topology([(0, 1), (1, 2)], num_layers=2)
    # every draft accepted: 8 tokens in 2 steps of 4 (k = 3); a step carries 4 positions everywhere
    sim, q = _run_one(graph, TransportConfig(mode="push", spec_k=3, acceptance=1.0), output_len=8)
    step = (0.001 + 4 * 2 / 1e5) + 0.001 + (0.001 + 4 * 100 / 1e5) + 0.001 + (0.001 + 4 * 2 / 1e5)
    assert sim.recorder.decode_tokens == 8 and len(sim.recorder.decode_lat) == 2
    assert sim.recorder.decode_lat == [pytest.approx(step, abs=1e-12)] * 2
    assert q.decoded == 8
    # nothing accepted: one token a step, each step still paying for the drafts (never past the end)
    sim, q = _run_one(graph, TransportConfig(mode="push", spec_k=3, acceptance=0.0), output_len=3)
    assert sim.recorder.decode_tokens == 3 and len(sim.recorder.decode_lat) == 3 and q.decoded == 3


@pytest.mark.parametrize("mode", ["push", "client"])
def test_every_query_gets_exactly_its_tokens_with_speculation(mode):
    ranges = [(0, 3), (0, 2), (2, 5), (3, 6), (5, 8), (4, 8)]
    graph = make_topology(ranges, num_layers=8, kv_capacity=40_000)
    sim = make_sim(graph, kv_settings=KvSettings(hwm=0.9, output_ratio=0.6, avg_output=20),
                   transport=TransportConfig(mode=mode, spec_k=4, acceptance=0.7))
    rng = random.Random(3)
    queries = [Query(i, rng.randint(1, 300), rng.randint(0, 40), rng.uniform(0, 2.0)) for i in range(150)]
    for q in queries:
        sim.loop.at(q.arrival, sim.submit, q)
    finished = []
    sim.hooks.done.append(finished.append)
    sim.loop.run(float("inf"))
    assert sorted(q.qid for q in finished) == list(range(150))
    assert all(q.decoded == q.output_len for q in queries)
    assert sim.recorder.decode_tokens == sum(q.output_len for q in queries)
    assert len(sim.recorder.decode_lat) < sim.recorder.decode_tokens  # steps yielded several tokens


def _regions_topology():
    """4 nodes: {0, 1} and {2, 3} are regions (1 ms, 1e9 B/s inside; 50 ms, 1e8 B/s between);
    the file's client reaches every node in 5 ms."""
    nodes = tuple(NodeSpec(f"n{i}", "X", (0.0, 1.0, 1.0)) for i in range(4))
    links = []
    for u in range(4):
        links += [LinkSpec(SOURCE, u, 1e7, 0.005), LinkSpec(u, SINK, 1e7, 0.005)]
        for v in range(4):
            if u != v:
                same = (u < 2) == (v < 2)
                links.append(LinkSpec(u, v, 1e9 if same else 1e8, 0.001 if same else 0.050))
    return Topology(nodes, tuple(links), num_layers=2, activation_bytes=100, token_bytes=2)


def test_regions_and_a_relocated_client():
    topo = _regions_topology()
    assert node_regions(topo) == [0, 0, 1, 1]
    assert node_regions(topo, intra_max_s=0.1) == [0, 0, 0, 0]
    moved = relocate_client(topo, 1)
    assert moved.latency(SOURCE, 3) == 0.001 and moved.latency(3, SINK) == 0.001
    assert moved.latency(SOURCE, 0) == 0.050 and moved.bytes_per_s(0, SINK) == topo.bytes_per_s(0, 2)
    assert moved.latency(0, 1) == topo.latency(0, 1)  # node-to-node links untouched
    with pytest.raises(ConfigError):
        relocate_client(topo, 2)


def test_client_region_changes_only_the_client_links_of_a_run():
    graph = StageGraph.build(_regions_topology(), {0: Assignment(0, 1, 10**9, CAPS), 3: Assignment(1, 2, 10**9, CAPS)})
    assert client_graph(graph, TransportConfig()) is graph
    near = client_graph(graph, TransportConfig(client_region=0))
    assert near.latency(SOURCE, 0) == 0.001 and near.latency(3, SINK) == 0.050
    _, q0 = _run_one(near, TransportConfig(mode="client", client_region=0))
    _, q1 = _run_one(client_graph(graph, TransportConfig(client_region=1)), TransportConfig(mode="client"))
    # client-driven: each of the 2 hops is a round trip to the client, one of them across regions,
    # wherever the client is (only the few token-id bytes cross other links: < 1 us apart)
    assert q0.finished == pytest.approx(q1.finished, abs=1e-6)
    _, far_push = _run_one(graph, TransportConfig(mode="push"))
    assert far_push.finished < q0.finished


def test_client_mode_needs_client_links():
    ranges = [(0, 1), (1, 2)]
    graph = make_topology(ranges, num_layers=2, links=[(SOURCE, 0), (0, 1), (1, SINK)])
    with pytest.raises(ConfigError, match="client link"):
        make_sim(graph, transport=TransportConfig(mode="client"))
    make_sim(graph, transport=TransportConfig(mode="push"))
