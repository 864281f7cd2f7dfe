"""Shared builders for the simulator tests (no tests here): tiny clusters, round-number profiles."""

from __future__ import annotations

import random

from p2pserve.sim.batching import BatchCaps
from p2pserve.sim.cluster import ClusterSim
from p2pserve.sim.kv import KvEstimator, KvSettings
from p2pserve.sim.profiles import LayerLatency
from p2pserve.sim.schedulers import make_scheduler
from p2pserve.sim.topology import SINK, SOURCE, LinkSpec, NodeSpec, Topology

#: prompt: 1 ms per token per layer; decode: flat 1 ms per layer (2 ms for a single token)
LINEAR = LayerLatency.from_points([(0, 0.0), (10_000, 10_000.0)], [(0, 1.0), (10_000, 1.0)])
CAPS = BatchCaps(prompt_max_requests=4, prompt_max_tokens=8192, decode_max_tokens=64)


def make_topology(ranges, num_layers, bandwidth=1e5, latency=1e-3, token_bytes=2, act_bytes=100,
                  kv_capacity=10**9, caps=CAPS, links=None):
    """Nodes with ``ranges`` (list of (start, end)), fully linked unless ``links`` is given."""
    nodes = [NodeSpec(i, "X", s, e, kv_capacity, caps) for i, (s, e) in enumerate(ranges)]
    spec = LinkSpec(bandwidth, latency)
    if links is None:
        links = {}
        for i in range(len(ranges)):
            links[(SOURCE, i)] = spec
            links[(i, SINK)] = spec
            for j in range(len(ranges)):
                if i != j:
                    links[(i, j)] = spec
    return Topology.build(num_layers, token_bytes, act_bytes, nodes, links)


def make_sim(topo, scheduler="iwrr", flows=None, seed=0, kv_settings=None, entry_overhead=False,
             kv_mask=True, batch_policy=None, kv_model="reserve"):
    """A ClusterSim on ``topo`` with LINEAR latency everywhere."""
    if flows is None:
        flows = {}
        for u, edges in topo.out_edges.items():
            for e in edges:
                flows[(u, e.dst)] = 1.0
    caps = {i: n.kv_capacity for i, n in topo.nodes.items()}
    per_layer = [0.0] * topo.num_layers
    for n in topo.nodes.values():
        for l in range(n.start, n.end):
            per_layer[l] += n.kv_capacity / n.layers
    kv = KvEstimator(caps, kv_settings or KvSettings.offline(), min(per_layer))
    sched = make_scheduler(scheduler, flows, random.Random(seed))
    return ClusterSim(topo, sched, kv, {i: LINEAR for i in topo.nodes}, entry_overhead=entry_overhead,
                      kv_mask=kv_mask, batch_policy=batch_policy, kv_model=kv_model)
