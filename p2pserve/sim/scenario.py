"""Build a simulation's static inputs from Helix files: topology, assignments, routing graph, flows.

A scenario is one or more *parts*, each a Helix cluster file plus a placement on it. One part is
the normal case; the separate-pipelines baseline has one part per GPU type (the authors' layouts
give one cluster and one solution per type), joined under one coordinator but never linked to
each other. Node indices of later parts are offset so that they stay distinct.

Sources of each number:

* node throughput ``T_i(k)`` (max-flow node capacities, and the Swarm-style prior):
  ``helix.throughput.node_throughput_tables`` -- the authors' formula, per part;
* max-flow and its edge flows (IWRR weights): ``placement.maxflow.max_flow``;
* batch caps and KV capacity: ``machine_params.json``, or the layout's ``simulator_cluster.ini``
  when it has one (needed where a node holds more layers than the json tabulates);
* link bandwidth: the file's number as bytes/s (``BandwidthConvention.HELIX``) by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Mapping, Sequence

from p2pserve.errors import ConfigError
from p2pserve.helix import format as hf
from p2pserve.helix.topology import topology_from_helix
from p2pserve.placement.maxflow import max_flow
from p2pserve.placement.planner import PlannerConfig, plan_for_topology
from p2pserve.placement.profile import LatencyProfile
from p2pserve.placement.topology import BandwidthConvention, LinkSpec, Topology
from p2pserve.sim.batching import BatchCaps
from p2pserve.sim.graph import Assignment, StageGraph
from p2pserve.sim.profiles import LayerLatency, layer_latency
from p2pserve.types import SINK_INDEX, SOURCE_INDEX

Placement = Mapping[int, tuple[int, int]]


@dataclass
class Part:
    """One cluster file with a placement on it (and optional per-node KV capacities)."""

    cluster: hf.HelixCluster
    placement: Placement
    kv_capacity: Mapping[int, int] | None = None


@dataclass
class Scenario:
    """Everything static a run needs.

    ``part_of`` says which part each serving node came from; ``root`` is the Helix data root the
    run reads its traces from (None: the default, see ``p2pserve.helix.root``).
    """

    model: str
    graph: StageGraph
    flows: dict[tuple[int, int], float]
    flow_value: float
    latencies: dict[int, LayerLatency]
    speed_prior: dict[int, float]
    layer_capacity: float
    parts: list[Part] = field(default_factory=list)
    part_of: dict[int, int] = field(default_factory=dict)
    root: Path | None = None

    def describe(self) -> dict:
        """Small JSON-friendly summary."""
        return {
            "model": self.model,
            "nodes": len(self.graph.assignments),
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


def part_topology(
    cluster: hf.HelixCluster,
    model: str,
    kmax: int | None = None,
    convention: BandwidthConvention = BandwidthConvention.HELIX,
    root: Path | None = None,
) -> Topology:
    """The planner's topology of ``cluster`` with T tables extended to ``kmax`` layers."""
    topo = topology_from_helix(cluster, model, convention, root=root)
    if kmax is None or all(n.max_layers >= kmax for n in topo.nodes):
        return topo
    # Layouts may hold more layers on a node than the tables cover (separate pipelines put 20
    # LLaMA-70B layers on an A100); extend T so the max-flow still sees those nodes.
    nodes = tuple(
        replace(n, throughput=tuple(extend_throughput(list(n.throughput), kmax))) for n in topo.nodes
    )
    return replace(topo, nodes=nodes)


def join_topologies(parts: Sequence[Topology]) -> Topology:
    """One topology over the nodes of ``parts`` in order (indices offset), sharing the source
    and sink, with no links between parts. Model sizes and convention come from the first."""
    nodes, links, offset = [], [], 0
    for topo in parts:
        nodes.extend(topo.nodes)
        links.extend(
            LinkSpec(_shift(l.src, offset), _shift(l.dst, offset), l.bandwidth, l.latency_s) for l in topo.links
        )
        offset += topo.num_nodes
    first = parts[0]
    return replace(first, nodes=tuple(nodes), links=tuple(links), name="+".join(t.name for t in parts),
                   missing_links=())


def _shift(i: int, offset: int) -> int:
    return i if i in (SOURCE_INDEX, SINK_INDEX) else i + offset


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


def _checked_placement(part: Part, num_layers: int) -> dict[int, tuple[int, int]]:
    """The part's non-empty ranges; raises :class:`ConfigError` on an impossible one."""
    cl = part.cluster
    placement = {i: r for i, r in part.placement.items() if r[1] > r[0]}
    for i, (s, e) in placement.items():
        if not (0 <= i < cl.num_nodes and 0 <= s < e <= num_layers):
            raise ConfigError(f"placement entry {i}: [{s}, {e}) is not valid for {cl.name}")
    return placement


def build_scenario(
    model: str,
    parts: list[Part],
    convention: BandwidthConvention = BandwidthConvention.HELIX,
    root: Path | None = None,
) -> Scenario:
    """Join ``parts`` into one scenario (see module docstring)."""
    mp = hf.load_machine_params(model, root)
    flows: dict[tuple[int, int], float] = {}
    flow_value = 0.0
    topos: list[Topology] = []
    assignments: dict[int, Assignment] = {}
    latencies: dict[int, LayerLatency] = {}
    prior: dict[int, float] = {}
    part_of: dict[int, int] = {}
    offset = 0
    for index, part in enumerate(parts):
        placement = _checked_placement(part, mp.num_layers)
        kmax = max((e - s for s, e in placement.values()), default=1)
        ptopo = part_topology(part.cluster, model, kmax, convention, root)
        fr = max_flow(ptopo, placement)
        flow_value += fr.value
        for (u, v), f in fr.edge_flows.items():
            flows[(_shift(u, offset), _shift(v, offset))] = f
        for i, (s, e) in sorted(placement.items()):
            gpu, k, idx = part.cluster.node_types[i], e - s, i + offset
            kv = part.kv_capacity.get(i) if part.kv_capacity else None
            assignments[idx] = Assignment(s, e, int(kv) if kv is not None else _kv(mp, gpu, k), _caps(mp, gpu, k))
            latencies[idx] = layer_latency(model, gpu, root)
            prior[idx] = ptopo.nodes[i].throughput[k] * k
            part_of[idx] = index
        topos.append(ptopo)
        offset += part.cluster.num_nodes
    graph = StageGraph.build(join_topologies(topos), assignments)
    if not graph.covers_model():
        raise ConfigError("the placement leaves no source-to-sink path through all layers")
    layer_kv = min_layer_kv(assignments, mp.num_layers)
    return Scenario(model, graph, flows, flow_value, latencies, prior, layer_kv, list(parts), part_of, root)


def min_layer_kv(assignments: Mapping[int, Assignment], num_layers: int) -> float:
    """Tokens of KV the least-provisioned layer can hold, summed over the nodes holding it."""
    per_layer = [0.0] * num_layers
    for a in assignments.values():
        for l in range(a.start, a.end):
            per_layer[l] += a.kv_capacity / a.layers
    return min(per_layer)


def topology_scenario(topo: Topology, placement: Placement, max_input_len: int = 2048,
                      root: Path | None = None) -> Scenario:
    """A scenario from the planner's :class:`Topology` alone, without a cluster file.

    This is what a coordinator has for a live swarm. Every serving node must carry a latency
    profile and its KV capacity for the layers it holds (``NodeSpec.profile``,
    ``kv_capacity[k]``); batch caps come from ``decode_max_tokens[k]`` (0: none) and
    ``prompt_max_requests[k]`` (absent: one prompt of ``max_input_len`` tokens). Edge flows are
    the placement's max-flow on ``topo``'s own links and bandwidth convention. ``root``: where
    the workload traces are read (the Helix data root by default). On a Helix cluster it builds
    the same scenario as :func:`build_scenario` (``tests/unit/sim/test_sim_topology_scenario.py``).
    """
    ranges = {i: (int(s), int(e)) for i, (s, e) in placement.items() if e > s}
    assignments: dict[int, Assignment] = {}
    latencies: dict[int, LayerLatency] = {}
    prior: dict[int, float] = {}
    for i, (s, e) in sorted(ranges.items()):
        if not (0 <= i < topo.num_nodes and 0 <= s < e <= topo.num_layers):
            raise ConfigError(f"placement entry {i}: [{s}, {e}) is not valid for {topo.name or 'the topology'}")
        node, k = topo.nodes[i], e - s
        kv = node.kv_capacity[k] if k < len(node.kv_capacity) else 0
        if node.profile is None or kv <= 0:
            raise ConfigError(f"node {node.name} has no latency profile or KV capacity for {k} layers: "
                              "it cannot be simulated")
        req = node.prompt_max_requests[k] if k < len(node.prompt_max_requests) else 1
        dmax = node.decode_max_tokens[k] if k < len(node.decode_max_tokens) else 0
        caps = BatchCaps(req, req * max_input_len, dmax if dmax > 0 else 1 << 30)
        assignments[i] = Assignment(s, e, int(kv), caps)
        latencies[i] = _profile_latency(node.profile)
        prior[i] = node.throughput[k] * k if k < len(node.throughput) else 0.0
    graph = StageGraph.build(topo, assignments)
    if not graph.covers_model():
        raise ConfigError("the placement leaves no source-to-sink path through all layers")
    fr = max_flow(topo, ranges)
    layer_kv = min_layer_kv(assignments, topo.num_layers)
    return Scenario(topo.model, graph, dict(fr.edge_flows), fr.value, latencies, prior, layer_kv,
                    [], {i: 0 for i in assignments}, root)


@lru_cache(maxsize=64)
def _profile_latency(profile: LatencyProfile) -> LayerLatency:
    # Tabulating costs ~10k interpolations; nodes of one GPU type share one profile.
    return LayerLatency.from_profile(profile)


def helix_part(cluster_path: str | Path, placement_path: str | Path, kv_from_layout: bool = True) -> Part:
    """A part from a Helix cluster file and a ``*_sol.ini`` (KV from the layout when present)."""
    cluster = hf.load_cluster(cluster_path)
    placement = hf.load_solution(placement_path)
    kv = None
    if kv_from_layout:
        sim_ini = hf.sibling_simulator_cluster(placement_path)
        if sim_ini is not None:
            kv = hf.read_kv_capacities(sim_ini)
    return Part(cluster, placement, kv)


def planner_part(cluster_path: str | Path, model: str, time_limit_s: float = 20.0, seed: int = 0,
                 root: Path | None = None, work: int | None = None, objective: str = "throughput") -> Part:
    """A part whose placement comes from our planner (``placement.planner.plan_for_topology``;
    ``objective``: ``throughput``, the default, or Helix's ``max-flow``), solved on the cluster's
    Helix topology (``work``: evaluation budget, see ``PlannerConfig.work``)."""
    cluster = hf.load_cluster(cluster_path)
    topo = topology_from_helix(cluster, model, root=root)
    cfg = PlannerConfig(objective=objective, time_limit_s=time_limit_s, seed=seed, work=work)
    solution = plan_for_topology(topo, cfg)
    return Part(cluster, dict(solution.assignments), None)
