"""Shared builders for the simulator tests: tiny clusters, round-number profiles."""

from __future__ import annotations

import random

from p2pserve.placement.topology import LinkSpec, NodeSpec, Topology
from p2pserve.sim.batching import BatchCaps
from p2pserve.sim.cluster import ClusterSim
from p2pserve.sim.graph import Assignment, StageGraph
from p2pserve.sim.kv import KvEstimator, KvSettings
from p2pserve.sim.profiles import LayerLatency
from p2pserve.sim.schedulers import make_scheduler
from p2pserve.types import SINK_INDEX as SINK
from p2pserve.types import SOURCE_INDEX as SOURCE

#: prompt: 1 ms per token per layer; decode: flat 1 ms per layer (2 ms for a single token)
LINEAR = LayerLatency.from_points([(0, 0.0), (10_000, 10_000.0)], [(0, 1.0), (10_000, 1.0)])
CAPS = BatchCaps(prompt_max_requests=4, prompt_max_tokens=8192, decode_max_tokens=64)


def make_topology(ranges, num_layers, bandwidth=1e5, latency=1e-3, token_bytes=2, act_bytes=100,
                  kv_capacity=10**9, caps=CAPS, links=None):
    """A routing graph: nodes with ``ranges`` (list of (start, end)), fully linked unless ``links``
    (directed ``(u, v)`` pairs) is given; every link has ``bandwidth`` bytes/s and ``latency``."""
    nodes = tuple(NodeSpec(f"n{i}", "X", tuple([0.0] + [1.0] * num_layers)) for i in range(len(ranges)))
    if links is None:
        links = []
        for i in range(len(ranges)):
            links += [(SOURCE, i), (i, SINK)]
            links += [(i, j) for j in range(len(ranges)) if i != j]
    topo = Topology(nodes, tuple(LinkSpec(u, v, bandwidth, latency) for u, v in links), num_layers=num_layers,
                    activation_bytes=act_bytes, token_bytes=token_bytes)
    return StageGraph.build(topo, {i: Assignment(s, e, kv_capacity, caps) for i, (s, e) in enumerate(ranges)})


def make_sim(graph, scheduler="iwrr", flows=None, seed=0, kv_settings=None, entry_overhead=False,
             kv_mask=True, batch_policy=None, kv_model="reserve", transport=None):
    """A ClusterSim on ``graph`` with LINEAR latency everywhere (``transport``: a
    :class:`~p2pserve.sim.transport.TransportConfig`, default push without speculation)."""
    if flows is None:
        flows = {}
        for u, edges in graph.out_edges.items():
            for e in edges:
                flows[(u, e.dst)] = 1.0
    caps = {i: a.kv_capacity for i, a in graph.assignments.items()}
    per_layer = [0.0] * graph.num_layers
    for a in graph.assignments.values():
        for l in range(a.start, a.end):
            per_layer[l] += a.kv_capacity / a.layers
    kv = KvEstimator(caps, kv_settings or KvSettings.offline(), min(per_layer))
    sched = make_scheduler(scheduler, flows, random.Random(seed), graph)
    return ClusterSim(graph, sched, kv, {i: LINEAR for i in graph.assignments}, entry_overhead=entry_overhead,
                      kv_mask=kv_mask, batch_policy=batch_policy, kv_model=kv_model, transport=transport,
                      spec_seed=seed)
