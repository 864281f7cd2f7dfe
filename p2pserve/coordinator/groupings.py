"""Which TP groups each machine agent runs: the coordinator's grouping decision (pure, no I/O).

A machine agent announces its slots, a slot's measured decode profile and the links between its
slots (``MachineInfo``). For every candidate grouping of a machine (``placement/grouping.py``'s
``machine_groupings``: powers of two the model splits into), each group becomes a node whose
``T[k]`` is estimated from the slot's profile by HexGen's cost model (``placement/tp_cost.py``):
a layer's time per token is the slot's divided by ``d`` plus two all-reduces of the decode
batch's hidden states over the group's slowest measured link, amortised over the batch. The
planner then places layers on those nodes plus every peer not run by a machine agent, and its
max-flow (the coordinator's objective) scores the candidate. Under this model a group does the
same work per token as its slots would as pipeline stages, plus its all-reduces, so max-flow
prefers TP only where a pipeline's extra hops cost more (slow links between nodes); HexGen's
gains are in latency, which max-flow does not score (docs/hexgen.md). Machines are chosen one at a time, the others fixed
(coordinate ascent, like ``plan_grouping``), from the groupings they run now; a machine changes
only when the gain beats ``hysteresis`` (a regroup reloads layers). With a fixed ``policy``
degree every machine runs groups of that degree (the largest allowed one below it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from p2pserve.dht.machine_info import MachineInfo
from p2pserve.dht.records import PeerInfo
from p2pserve.errors import ConfigError, PlanningError
from p2pserve.placement.planner import PlannerConfig, plan_for_topology
from p2pserve.placement.topology import LinkSpec, NodeSpec, Topology
from p2pserve.placement.tp_cost import LinkCost, allreduce_s
from p2pserve.types import SINK_INDEX, SOURCE_INDEX

Grouping = tuple[int, ...]


@dataclass(frozen=True)
class GroupingPolicy:
    """``degree``: 0 chooses (auto), else every machine runs groups of this TP degree.
    ``batch``: decode tokens per step the all-reduces are amortised over. ``work``: planner
    evaluations per candidate. ``hysteresis``: relative gain a change of grouping must bring."""

    degree: int = 0
    batch: int = 8
    work: int = 200
    hysteresis: float = 0.1
    bandwidth: float = 1e8  # bytes/s assumed between nodes (links of groups that do not exist yet)
    rtt: float = 0.01

    @staticmethod
    def parse(text: str) -> "GroupingPolicy":
        """``auto`` or a degree (``--grouping`` of ``p2pserve coordinator``)."""
        if text == "auto":
            return GroupingPolicy()
        if text.isdigit() and int(text) in (1, 2, 4, 8):
            return GroupingPolicy(degree=int(text))
        raise ConfigError(f"--grouping takes auto or a TP degree 1, 2, 4 or 8, not {text!r}")


def candidate_groupings(info: MachineInfo) -> list[Grouping]:
    """Every split of the machine's slots into allowed degrees, largest groups first."""
    n, allowed = len(info.gpus), sorted(set(info.tp_degrees) | {1})
    out: list[Grouping] = []

    def rec(left: int, top: int, acc: tuple[int, ...]) -> None:
        if left == 0:
            out.append(acc)
            return
        for d in reversed(allowed):
            if d <= min(left, top):
                rec(left - d, d, acc + (d,))

    rec(n, n, ())
    return out


def current_grouping(info: MachineInfo) -> Grouping | None:
    """The degrees the machine runs now, in slot order (None if it runs nothing yet)."""
    if not info.groups:
        return None
    return tuple(len(g.slots) for g in sorted(info.groups, key=lambda g: min(g.slots)))


def fixed_grouping(info: MachineInfo, degree: int) -> Grouping:
    """Groups of the largest allowed degree up to ``degree``, then smaller ones for the rest."""
    d = max(x for x in set(info.tp_degrees) | {1} if x <= degree)
    return next(g for g in candidate_groupings(info) if g[0] <= d)


def group_table(info: MachineInfo, slots: Sequence[int], act_bytes: int, batch: int) -> tuple[float, ...]:
    """Estimated tokens/s of a group over ``slots`` holding k = 1 .. d*K layers (index 0: 0.0).

    Per token and layer: the slot's time at ceil(k/d) layers / d + 2 all-reduces of ``batch``
    hidden states / batch."""
    profile = info.gpus[slots[0]].throughput_decode
    d = len(slots)
    if not profile:
        return (0.0,)
    bottleneck = info.bottleneck(list(slots)) if d > 1 else (1.0, 0.0)
    if bottleneck is None:  # a pair never measured: keep those slots apart
        return (0.0,)
    link = LinkCost(bus_bytes_per_s=bottleneck[0], latency_s=bottleneck[1])
    comm = 2.0 * allreduce_s(batch * act_bytes, d, link) / batch
    table = [0.0]
    for k in range(1, d * len(profile) + 1):
        j = -(-k // d)  # each slot holds 1/d of k layers: the memory (and KV room) of ceil(k/d) whole ones
        single = 1.0 / (j * profile[j - 1])  # the slot's seconds per token and layer at that depth
        table.append(1.0 / (k * (single / d + comm)))
    return tuple(table)


def _nodes(machines: Mapping[str, MachineInfo], choice: Mapping[str, Grouping], others: Mapping[str, PeerInfo],
           act_bytes: int, batch: int) -> list[NodeSpec]:
    nodes = [NodeSpec(name=pid, gpu_type=p.device, throughput=(0.0, *p.throughput_decode),
                      memory_bytes=float(p.weights_memory_bytes)) for pid, p in sorted(others.items())]
    for mid in sorted(machines):
        at = 0
        for i, d in enumerate(choice[mid]):
            table = group_table(machines[mid], range(at, at + d), act_bytes, batch)
            if len(table) > 1:
                nodes.append(NodeSpec(name=f"{mid}/{i}", gpu_type=f"tp{d}", throughput=table))
            at += d
    return nodes


def score(machines, choice, others, num_layers: int, act_bytes: int, policy: GroupingPolicy) -> float:
    """The planner's decode estimate over the nodes of ``choice`` (-1 if they cannot hold the model)."""
    nodes = _nodes(machines, choice, others, act_bytes, policy.batch)
    if not nodes:
        return -1.0
    links = []
    for i in range(len(nodes)):
        links += [LinkSpec(SOURCE_INDEX, i, policy.bandwidth, policy.rtt / 2), LinkSpec(i, SINK_INDEX, policy.bandwidth, policy.rtt / 2)]
        links += [LinkSpec(i, j, policy.bandwidth, policy.rtt / 2) for j in range(len(nodes)) if j != i]
    topo = Topology(nodes=tuple(nodes), links=tuple(links), num_layers=num_layers, activation_bytes=act_bytes,
                    token_bytes=8)
    try:
        cfg = PlannerConfig(objective="max-flow", work=policy.work, time_limit_s=30.0, use_milp=False)
        return plan_for_topology(topo, cfg).max_flow
    except PlanningError:
        return -1.0


def choose_groupings(machines: Mapping[str, MachineInfo], peers: Mapping[str, PeerInfo], num_layers: int,
                     act_bytes: int, policy: GroupingPolicy = GroupingPolicy()) -> dict[str, list[int]]:
    """Every machine's grouping (degrees in slot order): module docstring."""
    if not machines:
        return {}
    if policy.degree:
        return {mid: list(fixed_grouping(info, policy.degree)) for mid, info in machines.items()}
    theirs = {g.peer_id for info in machines.values() for g in info.groups}
    others = {pid: p for pid, p in peers.items() if pid not in theirs and p.state != "draining"
              and p.max_layers > 0 and len(p.throughput_decode) == p.max_layers}
    best = {mid: current_grouping(info) or candidate_groupings(info)[-1] for mid, info in machines.items()}
    value = score(machines, best, others, num_layers, act_bytes, policy)
    for mid in sorted(machines):
        for cand in candidate_groupings(machines[mid]):
            if cand == best[mid]:
                continue
            trial = {**best, mid: cand}
            v = score(machines, trial, others, num_layers, act_bytes, policy)
            if v > max(value, 0.0) * (1.0 + policy.hysteresis) or (value < 0 <= v):
                best, value = trial, v
    return {mid: list(g) for mid, g in best.items()}
