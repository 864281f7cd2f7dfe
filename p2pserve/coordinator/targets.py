"""Target ranges: where each plannable peer should be (pure; the planner does the solving).

:func:`build_topology` turns a :class:`~p2pserve.coordinator.snapshot.Snapshot` into the
planner's ``Topology``; :func:`plan_targets` calls the planner's full solve or its churn
handling (join, leave, periodic) on it, gives idle peers a replica (:func:`replicate_idle`) and falls
back to :func:`greedy_targets` when the planner refuses (swarm too small).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Mapping, NamedTuple, Optional, Sequence

from p2pserve.config import CoordinatorConfig
from p2pserve.coordinator.trigger import Trigger
from p2pserve.coordinator.scale_targets import is_large, large_swarm_targets
from p2pserve.coordinator.snapshot import Snapshot
from p2pserve.dht.records import PeerInfo
from p2pserve.errors import ConfigError, PlanningError
from p2pserve.placement import churn as inc
from p2pserve.placement.guard import Check
from p2pserve.placement.heuristics import coverage, fill_weakest_windows, petals_greedy
from p2pserve.placement.moves import by_index
from p2pserve.placement.planner import PlannerConfig
from p2pserve.placement.scale import cells_by_name, plan_at_scale
from p2pserve.placement.profile import LatencyProfile
from p2pserve.placement.topology import LinkSpec, NodeSpec, Topology
from p2pserve.types import SINK_INDEX, SOURCE_INDEX, LayerRange

logger = logging.getLogger(__name__)


#: Up to this many peers every pair gets a link (a measured one, else the default): the planner
#: plans such a swarm whole, and a few thousand links cost nothing.
DENSE_PEERS = 48
#: Above it, a peer with fewer measured links than this (a newcomer not yet probed, or one no
#: one could reach) gets default links to this many others, chosen by a hash of the two ids.
NEEDED_LINKS = 8


def build_topology(
    snap: Snapshot, ids: Sequence[str], cfg: CoordinatorConfig
) -> tuple[Topology, list[tuple[str, str]]]:
    """The planner's Topology over peers ``ids`` (node index = position in ``ids``).

    A link measured in only one direction is assumed symmetric. Up to :data:`DENSE_PEERS` peers,
    a pair measured in neither direction gets ``default_bandwidth``/``default_rtt`` and is
    returned in the defaulted list (flagged in the plan). Above, links exist only where they
    were measured (peers probe a bounded set, ``dht/probe_set.py``) or are needed: a peer with
    fewer than :data:`NEEDED_LINKS` measured links gets defaulted ones to that many others, so the
    topology, and the planner's work, grow with the peers rather than their square. Every peer is
    assumed reachable from clients at ``client_bandwidth``.
    """
    nodes = [peer_node(pid, snap.peers[pid]) for pid in ids]
    links: list[LinkSpec] = []
    sparse = _sparse_pairs(snap, ids) if len(ids) > DENSE_PEERS else None
    defaulted: list[tuple[str, str]] = sparse[1] if sparse else []
    for i, a in enumerate(ids):
        links.append(LinkSpec(SOURCE_INDEX, i, cfg.client_bandwidth, cfg.default_rtt / 2))
        links.append(LinkSpec(i, SINK_INDEX, cfg.client_bandwidth, cfg.default_rtt / 2))
        for j in (sparse[0].get(i, ()) if sparse else range(len(ids))):
            if i == j:
                continue
            b = ids[j]
            stat = snap.links.get((a, b)) or snap.links.get((b, a))
            if stat is None:
                if a < b and not sparse:
                    defaulted.append((a, b))
                links.append(LinkSpec(i, j, cfg.default_bandwidth, cfg.default_rtt / 2))
            else:
                links.append(LinkSpec(i, j, stat.bandwidth, stat.rtt / 2))
    topo = Topology(
        nodes=tuple(nodes),
        links=tuple(links),
        num_layers=cfg.num_layers,
        activation_bytes=cfg.activation_bytes,
        token_bytes=cfg.token_bytes,
    )
    return topo, defaulted


def _sparse_pairs(snap: Snapshot, ids: Sequence[str]) -> tuple[dict[int, list[int]], list[tuple[str, str]]]:
    """Each peer's linked peers (measured in either direction, plus defaults for peers with too
    few measured links), and the defaulted pairs."""
    index = {pid: i for i, pid in enumerate(ids)}
    linked: set[tuple[int, int]] = set()
    for a, b in snap.links:
        i, j = index.get(a), index.get(b)
        if i is not None and j is not None and i != j:
            linked.add((min(i, j), max(i, j)))
    degree = [0] * len(ids)
    for i, j in linked:
        degree[i] += 1
        degree[j] += 1
    defaulted: list[tuple[str, str]] = []
    for i, pid in enumerate(ids):
        if degree[i] >= NEEDED_LINKS:
            continue
        for x in _others(pid, i, len(ids)):
            pair = (min(i, x), max(i, x))
            if pair not in linked:
                linked.add(pair)
                a, b = sorted((pid, ids[x]))
                defaulted.append((a, b))
    out: dict[int, list[int]] = {}
    for i, j in sorted(linked):
        out.setdefault(i, []).append(j)
        out.setdefault(j, []).append(i)
    return {i: sorted(js) for i, js in out.items()}, defaulted


def _others(pid: str, i: int, n: int) -> set[int]:
    """Up to :data:`NEEDED_LINKS` peers other than ``i`` among ``n``, spread over the list from a
    hash of ``pid`` (the same for every coordinator; O(1) per peer, not a sort of all of them)."""
    h = int.from_bytes(hashlib.blake2b(pid.encode(), digest_size=8).digest(), "big")
    stride = max(1, (n - 1) // NEEDED_LINKS)
    return {(i + 1 + (h + k * stride) % (n - 1)) % n for k in range(min(NEEDED_LINKS, n - 1))}


def peer_node(pid: str, p: PeerInfo) -> NodeSpec:
    """A peer as a planner node. Its announced latency points and KV capacity, when it gives
    both, make the node simulable (``sim/plan_check.simulable``: the publish guard)."""
    k = len(p.throughput_decode)
    thr = (0.0, *p.throughput_decode) if k else (0.0,)
    profile, kv = None, ()
    if p.latency is not None and p.kv_capacity() > 0:
        profile = LatencyProfile(tuple(n for n, _ in p.latency.prompt), tuple(ms for _, ms in p.latency.prompt),
                                 tuple(n for n, _ in p.latency.decode), tuple(ms for _, ms in p.latency.decode))
        kv = (0,) + (p.kv_capacity(),) * k
    return NodeSpec(name=pid, gpu_type=p.device, throughput=thr, memory_bytes=float(p.weights_memory_bytes),
                    kv_capacity=kv, profile=profile)


def _guard_move(topo: Topology, current: Mapping[int, tuple[int, int]], moved: Mapping[int, tuple[int, int]],
                check: Check) -> tuple[Mapping[int, tuple[int, int]], bool]:
    """A churn re-solve's layer moves pass the publish guard too: they are published only if the
    check (a simulation) ranks them above the current placement, when that still covers every
    layer. Returns (placement, whether the current one was kept)."""
    if not current or min(coverage(topo.num_layers, current.values()), default=0) == 0:
        return moved, False
    try:
        keep = check(current) >= check(moved)
    except (ConfigError, PlanningError) as e:  # a placement the simulator cannot run: no verdict
        logger.warning(f"publish guard could not check a move ({e}); publishing it unchecked")
        return moved, False
    return (dict(current), True) if keep else (moved, False)


def greedy_targets(topo: Topology, ids: Sequence[str], current: Mapping[str, LayerRange]) -> dict[str, LayerRange]:
    """Fallback placement for peers ``ids``, moving as few loaded layers as possible.

    1. every peer keeps its current target if it still fits (no reload);
    2. peers without one (newcomers) take the contiguous window of ``max_layers`` layers whose
       weakest layer has the least throughput so far;
    3. only if some layer is still uncovered (a departure) is everything re-placed with the
       Petals-style greedy, newcomers last -- a reload, but a model with a hole serves nothing.
    """
    L = topo.num_layers
    kept: dict[int, LayerRange] = {}
    for i, pid in enumerate(ids):
        span = current.get(pid)
        k = topo.nodes[i].max_layers
        if span is not None and 0 <= span[0] < span[1] <= L and span[1] - span[0] <= k:
            kept[i] = (span[0], span[1])
    out = fill_weakest_windows(topo, kept, [i for i in range(len(ids)) if i not in kept])
    if min(coverage(L, out.values()), default=0) == 0:
        order = [i for i in range(len(ids)) if ids[i] in current] + [i for i in range(len(ids)) if ids[i] not in current]
        out = petals_greedy(topo, order)
    return {ids[i]: span for i, span in out.items()}


def replicate_idle(topo: Topology, ids: Sequence[str], targets: Mapping[str, LayerRange]) -> dict[str, LayerRange]:
    """Give every peer the planner left idle a replica on the weakest window (nobody else moves).

    An idle volunteer helps nobody; a replica adds capacity, KV room and a failover target.
    """
    idx = {pid: i for i, pid in enumerate(ids)}
    placed = {idx[pid]: span for pid, span in targets.items()}
    out = fill_weakest_windows(topo, placed, [i for i, pid in enumerate(ids) if pid not in targets])
    return {**dict(targets), **{ids[i]: span for i, span in out.items() if ids[i] not in targets}}


class Targets(NamedTuple):
    """What :func:`plan_targets` decided: targets by peer id, the method's text, and the cells
    (peer ids) a decomposed plan was made of (empty for a swarm planned whole)."""

    targets: dict[str, LayerRange]
    method: str
    cells: list[list[str]] = []


def plan_targets(
    topo: Topology,
    ids: Sequence[str],
    current: Mapping[str, LayerRange],
    cfg: CoordinatorConfig,
    trigger: Optional[Trigger] = None,
    check: Optional[Check] = None,
    cells: Sequence[Sequence[str]] = (),
) -> Targets:
    """Target ranges for peers ``ids`` with the planner's churn handling (``cells``: the current plan's).

    * no current placement: a full solve (``scale.plan_at_scale``: the planner on the whole swarm
      up to a few dozen peers, regions and cells beyond);
    * newcomers: ``churn.on_join`` (warm start, reload cost per moved layer);
    * a re-measure (:attr:`Trigger.remeasures`): ``churn.periodic`` (if the gain beats the reloads);
    * anything else (leave, served ranges or links changed): ``churn.on_leave`` (keeps the
      placement, recomputes flows, while every layer stays covered).

    With a ``check`` (a simulation of ``topo``, :data:`placement.guard.CheckFactory`) the full solve
    goes through the publish guard. Above a few dozen peers (:func:`scale_targets.is_large`) churn
    goes to :func:`scale_targets.large_swarm_targets`. Idle peers get a replica
    (:func:`replicate_idle`); if the planner fails, the greedy fallback covers what it can.
    """
    cur: dict[str, LayerRange] = {pid: (span[0], span[1]) for pid, span in current.items() if pid in set(ids)}
    out_cells: list[list[str]] = []
    try:
        pc = PlannerConfig(objective=cfg.objective, time_limit_s=cfg.solve_time_limit, seed=cfg.seed)
        if cur and is_large(topo):
            big = large_swarm_targets(topo, ids, cur, pc, cells)
            targets = {ids[i]: (int(s), int(e)) for i, (s, e) in big.assignments.items() if e > s}
            return Targets(replicate_idle(topo, ids, targets), big.method, big.cells)
        reload_cost = cfg.reload_cost_per_layer
        if reload_cost is None:
            reload_cost = inc.default_reload_cost(topo, cur, pc, cfg.reload_share)
        if not cur:
            result = plan_at_scale(topo, pc, check=check)  # today's planner up to ScaleConfig.direct_nodes
            method = f"solve:{result.method}"
            if "guard" in result.stats:
                method += f", guard kept {result.stats['guard']['chosen']}"
            assignments = result.assignments
            out_cells = cells_by_name(result)
        else:
            if any(pid not in cur for pid in ids):
                r = inc.on_join(topo, cur, pc, reload_cost, cfg.solve_time_limit, tolerance=cfg.churn_tolerance)
            elif trigger is not None and trigger.remeasures:
                # measurements changed what the links can carry: adopt a fresh solve only if
                # its gain beats the cost of the layers it would reload
                r = inc.periodic(topo, cur, pc, reload_cost)
            else:
                r = inc.on_leave(topo, cur, pc, reload_cost, cfg.solve_time_limit, tolerance=cfg.churn_tolerance)
            method = f"{r.plan.method} ({r.layers_moved} layers to load)"
            assignments = r.plan.assignments
            if check is not None and r.layers_moved > 0:
                assignments, kept = _guard_move(topo, by_index(topo, cur), assignments, check)
                method += ", guard kept the current placement" if kept else ", guard passed the move"
        targets = {ids[i]: (int(s), int(e)) for i, (s, e) in assignments.items() if e > s}
    except (PlanningError, ConfigError) as e:
        logger.warning(f"planner failed ({e}); using the greedy fallback")
        targets, method, out_cells = greedy_targets(topo, ids, cur), "greedy-fallback", []
    return Targets(replicate_idle(topo, ids, targets), method, out_cells)
