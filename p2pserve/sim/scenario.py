"""Build a simulation's static inputs from Helix files: nodes, links, routing graph, flows.

A scenario is one or more *parts*, each a Helix cluster file plus a placement on it. One part is
the normal case; the separate-pipelines baseline has one part per GPU type (the authors' layouts
give one cluster and one solution per type), joined under one coordinator but never linked to
each other. Node indices of later parts are offset so that they stay distinct.

Sources of each number:

* node throughput ``T_i(k)`` (max-flow node capacities, and the Swarm-style prior):
  ``helix.format.node_throughput_tables`` — the authors' formula, per part;
* max-flow and its edge flows (IWRR weights): ``coordinator.maxflow.max_flow``;
* batch caps and KV capacity: ``machine_params.json``, or the layout's ``simulator_cluster.ini``
  when it has one (needed where a node holds more layers than the json tabulates);
* link bandwidth: the file's number as bytes/s (``BandwidthConvention.HELIX``) by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

from p2pserve.helix import format as hf
from p2pserve.placement.maxflow import max_flow
from p2pserve.placement.topology import (
    SINK as C_SINK,
    SOURCE as C_SOURCE,
    BandwidthConvention,
    Topology as CoordTopology,
    topology_from_helix,
)
from p2pserve.errors import ConfigError
from p2pserve.sim._kv_capacity_ini import read_kv_capacities, sibling_simulator_cluster
from p2pserve.sim.batching import BatchCaps
from p2pserve.sim.profiles import LayerLatency, layer_latency
from p2pserve.sim.topology import SINK, SOURCE, LinkSpec, NodeSpec, Topology

Placement = Mapping[int, tuple[int, int]]


@dataclass
class Part:
    """One cluster file with a placement on it (and optional per-node KV capacities)."""

    cluster: hf.HelixCluster
    placement: Placement
    kv_capacity: Mapping[int, int] | None = None


@dataclass
class Scenario:
    """Everything static a run needs."""

    model: str
    topology: Topology
    flows: dict[tuple[int, int], float]
    flow_value: float
    latencies: dict[int, LayerLatency]
    speed_prior: dict[int, float]
    layer_capacity: float
    parts: list[Part] = field(default_factory=list)

    def describe(self) -> dict:
        """Small JSON-friendly summary."""
        return {
            "model": self.model,
            "nodes": len(self.topology.nodes),
            "max_flow_tokens_per_s": self.flow_value,
            "min_layer_kv_capacity_tokens": self.layer_capacity,
        }


def extend_throughput(row: list[float], kmax: int) -> list[float]:
    """``T[k]`` up to ``kmax``: beyond the table keep the token-layer rate ``k*T(k)`` constant."""
    out = list(row)
    last = len(out) - 1
    while len(out) <= kmax:
        k = len(out)
        out.append(out[last] * last / k if last > 0 else 0.0)
    return out


def coordinator_topology(
    cluster: hf.HelixCluster,
    model: str,
    kmax: int | None = None,
    convention: BandwidthConvention = BandwidthConvention.HELIX,
) -> CoordTopology:
    """The planner's topology of ``cluster`` with T tables extended to ``kmax`` layers."""
    topo = topology_from_helix(cluster, model, convention)
    if kmax is None or all(n.max_layers >= kmax for n in topo.nodes):
        return topo
    # Layouts may hold more layers on a node than the tables cover (separate pipelines put 20
    # LLaMA-70B layers on an A100); extend T so the max-flow still sees those nodes.
    nodes = tuple(
        replace(n, throughput=tuple(extend_throughput(list(n.throughput), kmax))) for n in topo.nodes
    )
    return replace(topo, nodes=nodes)


def _caps(mp: hf.MachineParams, gpu: str, k: int) -> BatchCaps:
    gp = mp.gpu(gpu)
    kk = min(k, gp.max_num_layers)  # the json stops at max_num_layers; reuse its last row
    req = gp.prompt_max_requests[kk]
    return BatchCaps(req, req * mp.max_input_len, gp.decode_max_tokens[kk])


def _kv(mp: hf.MachineParams, gpu: str, k: int) -> int:
    gp = mp.gpu(gpu)
    if k <= gp.max_num_layers:
        return mp.kv_capacity(gpu, k)
    # Beyond the table nothing is measured; keep the last row's total entries.
    return mp.kv_capacity(gpu, gp.max_num_layers)


def build_scenario(
    model: str,
    parts: list[Part],
    convention: BandwidthConvention = BandwidthConvention.HELIX,
) -> Scenario:
    """Join ``parts`` into one scenario (see module docstring)."""
    mp = hf.load_machine_params(model)
    L = mp.num_layers
    nodes: list[NodeSpec] = []
    links: dict[tuple[int, int], LinkSpec] = {}
    flows: dict[tuple[int, int], float] = {}
    flow_total = 0.0
    latencies: dict[int, LayerLatency] = {}
    prior: dict[int, float] = {}
    offset = 0
    for group, part in enumerate(parts):
        cl = part.cluster
        placement = {i: r for i, r in part.placement.items() if r[1] > r[0]}
        for i, (s, e) in placement.items():
            if not (0 <= i < cl.num_nodes and 0 <= s < e <= L):
                raise ConfigError(f"placement entry {i}: [{s}, {e}) is not valid for {cl.name}")
        kmax = max((e - s for s, e in placement.values()), default=1)
        ctopo = coordinator_topology(cl, model, kmax, convention)
        fr = max_flow(ctopo, placement)
        flow_total += fr.value

        def gid(i: int) -> int:
            return i if i in (C_SOURCE, C_SINK) else i + offset

        for (u, v), f in fr.edge_flows.items():
            flows[(_map(gid(u)), _map(gid(v)))] = f
        for i, (s, e) in sorted(placement.items()):
            gpu = cl.node_types[i]
            k = e - s
            kv = part.kv_capacity.get(i) if part.kv_capacity else None
            nodes.append(
                NodeSpec(
                    idx=i + offset,
                    gpu=gpu,
                    start=s,
                    end=e,
                    kv_capacity=int(kv) if kv is not None else _kv(mp, gpu, k),
                    caps=_caps(mp, gpu, k),
                    group=group,
                )
            )
            latencies[i + offset] = layer_latency(model, gpu)
            prior[i + offset] = ctopo.nodes[i].throughput[k] * k
        for link in ctopo.links:
            bw = convention.bytes_per_s(link.bandwidth)
            links[(_map(gid(link.src)), _map(gid(link.dst)))] = LinkSpec(bw, link.latency_s)
        offset += cl.num_nodes
    topo = Topology.build(L, mp.token_size_bytes, mp.activation_size_bytes, nodes, links)
    if not topo.covers_model():
        raise ConfigError("the placement leaves no source-to-sink path through all layers")
    per_layer = [0.0] * L
    for n in nodes:
        for l in range(n.start, n.end):
            per_layer[l] += n.kv_capacity / n.layers
    return Scenario(model, topo, flows, flow_total, latencies, prior, min(per_layer), list(parts))


def _map(i: int) -> int:
    """Coordinator SOURCE/SINK ids to the simulator's (they are equal today; keep one place)."""
    if i == C_SOURCE:
        return SOURCE
    if i == C_SINK:
        return SINK
    return i


def helix_part(cluster_path: str | Path, placement_path: str | Path, kv_from_layout: bool = True) -> Part:
    """A part from a Helix cluster file and a ``*_sol.ini`` (KV from the layout when present)."""
    cluster = hf.load_cluster(cluster_path)
    placement = hf.load_solution(placement_path)
    kv = None
    if kv_from_layout:
        sim_ini = sibling_simulator_cluster(placement_path)
        if sim_ini is not None:
            kv = read_kv_capacities(sim_ini)
    return Part(cluster, placement, kv)


def planner_part(cluster_path: str | Path, model: str, time_limit_s: float = 20.0, seed: int = 0) -> Part:
    """A part whose placement comes from our planner (``p2pserve.coordinator``)."""
    from p2pserve.sim.planner_adapter import plan_placement

    cluster = hf.load_cluster(cluster_path)
    return Part(cluster, plan_placement(cluster, model, time_limit_s=time_limit_s, seed=seed), None)
