"""Simulate a placement on tensor-parallel groups (multi-GPU machines, HexGen-style).

The Helix scenario (:mod:`p2pserve.sim.scenario`) reads per-GPU-type profiles and limits from
the artifact's files. Here a node is a TP group whose per-layer latency, KV capacity and
batch caps come from the same cost model the planner uses
(:mod:`p2pserve.placement.tp_cost`, one place for the formula): the node's
``NodeSpec.profile`` *is* the group's ``t_d(n)`` (single-GPU time / d + two all-reduces per
layer), tabulated into the simulator's :class:`~p2pserve.sim.profiles.LayerLatency`. Links,
flows and routing are the usual ones over the group topology
(:func:`p2pserve.placement.machines.group_topology`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Mapping

from p2pserve.errors import ConfigError
from p2pserve.placement.maxflow import max_flow
from p2pserve.placement.topology import Topology
from p2pserve.sim.batching import BatchCaps
from p2pserve.sim.graph import Assignment, StageGraph
from p2pserve.sim.profiles import LayerLatency
from p2pserve.sim.scenario import Scenario

#: Prompt batch limits of every group (Helix: up to 3 prompts of <= 2048 tokens on an A100).
PROMPT_MAX_REQUESTS = 2
MAX_INPUT_LEN = 2048


def group_scenario(topo: Topology, placement: Mapping[int, tuple[int, int]], root: Path | None = None) -> Scenario:
    """A :class:`Scenario` for ``placement`` on a group topology (every node has a profile)."""
    placement = {i: tuple(r) for i, r in placement.items() if r[1] > r[0]}
    assignments: dict[int, Assignment] = {}
    latencies: dict[int, LayerLatency] = {}
    prior: dict[int, float] = {}
    cache: dict[int, LayerLatency] = {}
    for i, (s, e) in sorted(placement.items()):
        node = topo.nodes[i]
        k = e - s
        if node.profile is None or not (0 <= s < e <= topo.num_layers) or k > node.max_layers:
            raise ConfigError(f"node {node.name}: range [{s}, {e}) is not servable")
        caps = BatchCaps(PROMPT_MAX_REQUESTS, PROMPT_MAX_REQUESTS * MAX_INPUT_LEN, node.decode_max_tokens[k])
        assignments[i] = Assignment(s, e, node.kv_capacity[k], caps)
        key = id(node.profile)
        if key not in cache:
            cache[key] = LayerLatency.from_profile(node.profile)
        latencies[i] = cache[key]
        prior[i] = node.throughput[k] * k
    graph = StageGraph.build(topo, assignments)
    if not graph.covers_model():
        raise ConfigError("the placement leaves no source-to-sink path through all layers")
    fr = max_flow(topo, placement)
    per_layer = [0.0] * topo.num_layers
    for a in assignments.values():
        for layer in range(a.start, a.end):
            per_layer[layer] += a.kv_capacity / a.layers
    return Scenario(topo.model, graph, dict(fr.edge_flows), fr.value, latencies, prior, min(per_layer), root=root)


def fixed_lengths_file(input_len: int, output_len: int, directory: str | None = None) -> str:
    """A one-row lengths csv (``input,output``) for :class:`~p2pserve.sim.run.SimConfig`'s
    ``lengths``: every query has these lengths (HexGen §3.1's 128 / 64 request)."""
    fd, path = tempfile.mkstemp(prefix="lengths-", suffix=".csv", dir=directory)
    with open(fd, "w") as f:
        f.write("input,output\n")
        f.write(f"{int(input_len)},{int(output_len)}\n")
    return path


def sim_score(duration: float = 60.0, seed: int = 0, warmup: float | None = None):
    """A grouping score for :func:`p2pserve.placement.grouping.plan_grouping`: the simulated
    offline decode tokens/s (Helix's rule, Azure conversation lengths, IWRR) of the planner's
    placement, over a ``duration``-second window after ``warmup`` seconds (default
    ``duration / 5``).

    Offline feeding admits requests until the KV cache is full, so a group with a large cache
    (TP-4/TP-8 of 48 GB GPUs: hundreds of requests) spends its first minutes prefilling them:
    at a 24 s warm-up and a 120 s window a full-price TP-8 grouping scores 758 tokens/s against
    1,208 in steady state (600 s + 600 s; docs/hexgen.md). Compare groupings in steady state."""
    from p2pserve.sim.run import SimConfig, simulate  # run imports scenario; keep this module light

    warm = duration / 5 if warmup is None else warmup

    def score(topo: Topology, solution) -> float:
        cfg = SimConfig(mode="offline", duration=duration, warmup=warm, seed=seed)
        return simulate(group_scenario(topo, solution.assignments), cfg).decode_throughput_tokens_per_s

    return score


def slo_score(spec, search=None):
    """A grouping score by HexGen's own metric: the peak Poisson request rate (requests/s) at
    which the planner's placement keeps SLO attainment >= ``spec.goal``
    (:func:`p2pserve.sim.slo.peak_rate`). The score remembers the best rate it has returned: a
    later candidate is first probed at that rate and, if it misses the goal there, scores
    ``best x attainment`` (below the incumbent) after one simulation instead of a bisection."""
    from p2pserve.sim.slo import SloSearch, peak_rate

    search = search or SloSearch()
    state = {"best": 0.0}

    def score(topo: Topology, solution) -> float:
        point = peak_rate(group_scenario(topo, solution.assignments), spec, search, at_least=state["best"])
        value = point.rate_qps if point.rate_qps > 0 else state["best"] * point.attainment
        state["best"] = max(state["best"], value)
        return value

    return score
