"""Multi-GPU machines and the TP groups formed from their GPUs, as a planner topology.

A :class:`MachineCluster` lists machines (a GPU type, a count, the single-GPU profile, the
intra-machine link) and the network between them. A *group* is a set of GPUs that runs as one
tensor-parallel node (:mod:`p2pserve.placement.tp_cost`); :func:`group_topology` turns a list
of groups into the planner's :class:`~p2pserve.placement.topology.Topology` (one node per
group, ``BYTES_PER_S`` links). Groups normally stay inside one machine (HexGen's heuristic);
a group spanning machines (HexGen §3.1's symmetric layout ii) pays the network in its
all-reduces. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from p2pserve.errors import ConfigError
from p2pserve.placement.gpu_specs import GpuSpec
from p2pserve.placement.profile import LatencyProfile
from p2pserve.placement.topology import BandwidthConvention, LinkSpec, NodeSpec, Topology
from p2pserve.placement.tp_cost import LLAMA2_70B, GroupCost, LinkCost, MemoryModel, ModelShape, tp_profile
from p2pserve.types import SINK_INDEX, SOURCE_INDEX


@dataclass(frozen=True)
class NetLink:
    """A network path between two machines (or a machine and the clients)."""

    bytes_per_s: float
    latency_s: float


@dataclass(frozen=True)
class Machine:
    """``count`` GPUs of one type in one box, joined by ``intra`` (PCIe/NVLink, fitted)."""

    name: str
    gpu: GpuSpec
    count: int
    profile: LatencyProfile
    intra: LinkCost
    region: str = ""


@dataclass(frozen=True)
class MachineCluster:
    """Machines and the network: ``lan`` between machines of one region, ``wan`` (or the
    ``regions`` entry for the pair) across regions, ``client`` from/to the coordinator."""

    name: str
    machines: tuple[Machine, ...]
    lan: NetLink
    wan: NetLink
    client: NetLink
    model: ModelShape = LLAMA2_70B
    regions: dict = field(default_factory=dict)
    decode_cap: int = 480
    memory: MemoryModel = MemoryModel()
    measured: dict = field(default_factory=dict)

    def net(self, a: int, b: int) -> NetLink:
        """The network path between machines ``a`` and ``b``."""
        ra, rb = self.machines[a].region, self.machines[b].region
        if ra == rb:
            return self.lan
        return self.regions.get((ra, rb)) or self.regions.get((rb, ra)) or self.wan

    @property
    def num_gpus(self) -> int:
        """GPUs in all machines."""
        return sum(m.count for m in self.machines)


#: One GPU: (machine index, GPU index inside the machine).
Gpu = tuple[int, int]


@dataclass(frozen=True)
class Group:
    """GPUs that run as one TP node; ``gpus[0]`` is the leader (its machine sends and receives
    the activations)."""

    gpus: tuple[Gpu, ...]

    @property
    def d(self) -> int:
        """TP degree."""
        return len(self.gpus)

    @property
    def machine(self) -> int:
        """The leader's machine."""
        return self.gpus[0][0]


def group_link(cluster: MachineCluster, group: Group) -> LinkCost:
    """The all-reduce cost of ``group``: its machine's fitted link, or, across machines, the
    network: a ring all-reduce takes ``2 (d - 1)`` steps, each paying the one-way latency."""
    machines = sorted({m for m, _ in group.gpus})
    intra = min((cluster.machines[m].intra for m in machines), key=lambda l: l.bus_bytes_per_s)
    if len(machines) == 1:
        return intra
    nets = [cluster.net(a, b) for a in machines for b in machines if a < b]
    bw = min(min(n.bytes_per_s for n in nets), intra.bus_bytes_per_s)
    lat = max(n.latency_s for n in nets)
    return LinkCost(bus_bytes_per_s=bw, latency_s=intra.latency_s + 2 * (group.d - 1) * lat)


def group_cost(cluster: MachineCluster, group: Group) -> GroupCost:
    """The cost model of ``group`` (:class:`~p2pserve.placement.tp_cost.GroupCost`)."""
    members = [cluster.machines[m] for m, _ in group.gpus]
    if not cluster.model.tp_ok(group.d):
        raise ConfigError(f"TP degree {group.d} does not divide {cluster.model.name}'s heads")
    prof = cluster.measured.get(group.gpus)
    if prof is None:  # not measured yet: HexGen's estimate from the single-GPU profiles
        prof = tp_profile([m.profile for m in members], group_link(cluster, group), cluster.model.act_bytes)
    mem = min(m.gpu.memory_bytes for m in members)
    return GroupCost(group.d, mem, prof, cluster.model, cluster.memory, decode_cap=cluster.decode_cap)


def group_name(cluster: MachineCluster, group: Group) -> str:
    """``machine/tpD:i,j`` naming the leader's machine, the degree and the GPUs."""
    m = cluster.machines[group.machine]
    gpus = ",".join(f"{cluster.machines[a].name}:{g}" if a != group.machine else str(g) for a, g in group.gpus)
    return f"{m.name}/tp{group.d}:{gpus}"


def group_node(cluster: MachineCluster, group: Group) -> NodeSpec:
    """One TP group as a planner node: T table, KV capacities, batch caps and profile."""
    cost = group_cost(cluster, group)
    kmax = cost.max_layers
    types = sorted({cluster.machines[m].gpu.name for m, _ in group.gpus})
    return NodeSpec(
        name=group_name(cluster, group),
        gpu_type=f"{'+'.join(types)}x{group.d}",
        throughput=cost.table(),
        memory_bytes=cost.memory_bytes * group.d,
        kv_capacity=cost.kv_table(),
        decode_max_tokens=(0,) + (cluster.decode_cap,) * kmax,
        profile=cost.profile,
    )


def group_topology(cluster: MachineCluster, groups: Sequence[Group]) -> Topology:
    """The planner's topology with one node per group (index = position in ``groups``)."""
    nodes = tuple(group_node(cluster, g) for g in groups)
    links: list[LinkSpec] = []
    c = cluster.client
    for i, g in enumerate(groups):
        links.append(LinkSpec(SOURCE_INDEX, i, c.bytes_per_s, c.latency_s))
        links.append(LinkSpec(i, SINK_INDEX, c.bytes_per_s, c.latency_s))
        for j, h in enumerate(groups):
            if i == j:
                continue
            if g.machine == h.machine:
                # Two groups of one box: activations cross PCIe/NVLink, not the network.
                intra = cluster.machines[g.machine].intra
                links.append(LinkSpec(i, j, intra.bus_bytes_per_s, intra.latency_s))
            else:
                n = cluster.net(g.machine, h.machine)
                links.append(LinkSpec(i, j, n.bytes_per_s, n.latency_s))
    m = cluster.model
    return Topology(
        nodes=nodes, links=tuple(links), num_layers=m.num_layers, activation_bytes=m.act_bytes,
        token_bytes=2, convention=BandwidthConvention.BYTES_PER_S, layer_bytes=m.layer_bytes,
        model=m.name, name=cluster.name,
    )
