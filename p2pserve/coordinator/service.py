"""The coordinator service: election candidate; when leader, plans and publishes.

Split in two on purpose:

* a **pure core** -- :class:`Snapshot`, :func:`decide_replan`, :func:`build_topology`,
  :func:`plan_targets`, :func:`make_plan`, :func:`plan_changed` -- that turns validated DHT
  records into a :class:`~p2pserve.dht.records.Plan` and decides *when* to re-plan. It is
  unit-tested without a network;
* a **thin async shell** -- :class:`CoordinatorService` -- that announces candidacy, reads the
  DHT, runs the core and publishes.

Planner. :func:`plan_targets` calls the planner's full solve / ``churn`` churn handling
(join, leave, periodic) on a ``Topology`` built from the records; :func:`greedy_targets` is the
fallback when the planner refuses (swarm too small). Flows always come from
``maxflow.max_flow`` over the ranges peers *serve now*, never over targets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Mapping, Optional, Sequence

from hivemind.utils import get_dht_time

from p2pserve.placement.heuristics import petals_greedy
from p2pserve.placement.maxflow import max_flow
from p2pserve.placement.topology import SINK, SOURCE, LinkSpec, NodeSpec, Topology
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.election import elect_leader, next_epoch
from p2pserve.dht.records import SINK as SINK_NAME
from p2pserve.dht.records import SOURCE as SOURCE_NAME
from p2pserve.dht.records import CoordinatorCandidate, Flow, LayerSpan, LinkInfo, LinkStat, PeerInfo, Plan
from p2pserve.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoordinatorConfig:
    """Planning parameters of one coordinator (to be folded into ``p2pserve/config.py``)."""

    num_layers: int
    activation_bytes: int = 8192  # bytes per token of hidden state (hidden_size x dtype bytes)
    token_bytes: int = 4  # bytes per token id on source/sink edges
    priority: int = 0  # election: higher wins
    coordinator_id: str = ""  # default: this node's libp2p peer id
    tick: Optional[float] = None  # loop period; default: the DHT candidate refresh period
    replan_period: float = 60.0  # re-plan at least this often even if nothing changed
    link_change_threshold: float = 0.3  # relative bandwidth change that triggers a re-plan
    default_bandwidth: float = 1.25e6  # bytes/s assumed for an unmeasured link (10 Mbit/s)
    default_rtt: float = 0.1  # seconds assumed for an unmeasured link
    client_bandwidth: float = 12.5e6  # bytes/s of source/sink edges (clients are not probed)
    objective: str = "throughput"  # planner objective: "throughput" (decode estimate) or "max-flow"
    solve_time_limit: float = 5.0  # wall-clock budget of one placement solve (s)
    reload_cost_per_layer: Optional[float] = None  # in the objective's units; None: from reload_share
    # Moving a whole model's worth of layers must gain this share of the objective. Peers flip
    # to new ranges one by one as they finish loading, so every move risks a window with less
    # coverage: move only for a real gain (measured links that undo a cross-region placement
    # gain ~40%; small re-shuffles after a join do not pay).
    reload_share: float = 0.25
    # Churn re-solves may give up this share of the best objective they found to load fewer
    # layers (``churn.fewest_moves_within``); 0 keeps the reload price alone.
    churn_tolerance: float = 0.0
    seed: int = 0
    # a new candidate only observes for this long before it may lead, so that it has seen every
    # live candidacy (default: one candidate TTL); avoids two leaders right after a start
    election_grace: Optional[float] = None

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ConfigError("CoordinatorConfig.num_layers must be >= 1")
        if self.activation_bytes < 1 or self.token_bytes < 1:
            raise ConfigError("activation_bytes and token_bytes must be >= 1")
        if not 0 <= self.churn_tolerance < 1:
            raise ConfigError("churn_tolerance must be in [0, 1)")
        if not 0 < self.link_change_threshold:
            raise ConfigError("link_change_threshold must be > 0")


# ================================================================================ pure core


@dataclass(frozen=True)
class Snapshot:
    """Validated live records at one instant: peers by id and links ``(from, to) -> stat``."""

    peers: Mapping[str, PeerInfo]
    links: Mapping[tuple[str, str], LinkStat] = field(default_factory=dict)

    @staticmethod
    def from_records(peers: Mapping[str, PeerInfo], link_infos: Sequence[LinkInfo]) -> "Snapshot":
        """Flatten LinkInfo records into directed link stats between live peers only."""
        links = {}
        for li in link_infos:
            if li.peer_id not in peers:
                continue
            for other, stat in li.links.items():
                if other in peers:
                    links[(li.peer_id, other)] = stat
        return Snapshot(dict(peers), links)

    def plannable(self) -> list[str]:
        """Peers the planner may give layers to: profiled and not draining (sorted ids)."""
        return sorted(
            pid for pid, p in self.peers.items()
            if p.state != "draining" and p.max_layers > 0 and len(p.throughput_decode) == p.max_layers
        )

    def serving_now(self) -> dict[str, LayerSpan]:
        """Ranges peers serve now (what flows are computed over); draining peers excluded."""
        return {pid: p.serving for pid, p in self.peers.items() if p.serving is not None and p.state != "draining"}


@dataclass(frozen=True)
class Summary:
    """What the re-plan decision looks at."""

    peers: frozenset[str]
    spans: tuple[tuple[str, LayerSpan], ...]
    bandwidth: Mapping[tuple[str, str], float]
    link_ceiling: float = float("inf")  # bytes/s above which no link can limit a flow

    @staticmethod
    def of(s: Snapshot, activation_bytes: int | None = None) -> "Summary":
        """Summarize a snapshot; with ``activation_bytes``, links faster than any peer's best
        decode throughput could ever use are marked as unable to bind."""
        ceiling = float("inf")
        if activation_bytes:
            best = max((max(p.throughput_decode, default=0.0) for p in s.peers.values()), default=0.0)
            if best > 0:
                ceiling = best * activation_bytes
        return Summary(
            frozenset(s.plannable()),
            tuple(sorted(s.serving_now().items())),
            {k: v.bandwidth for k, v in s.links.items()},
            ceiling,
        )


def decide_replan(
    prev: Optional[Summary], cur: Summary, now: float, last_plan_at: Optional[float], cfg: CoordinatorConfig
) -> Optional[str]:
    """Why to re-plan now, or ``None`` to keep the current plan (refreshing it is separate).

    Re-plans on: no plan yet, a peer joined or left, a peer flipped to another served range,
    a link whose bandwidth changed by more than ``link_change_threshold`` (relative) or appeared,
    and every ``replan_period``. A link that read faster than ``link_ceiling`` both times cannot
    limit any flow, so its changes are noise to the planner (a fast link's probe reading
    jitters a lot and would otherwise trigger a full solve every few seconds).
    """
    if prev is None or last_plan_at is None:
        return "initial"
    joined = cur.peers - prev.peers
    left = prev.peers - cur.peers
    if joined or left:
        parts = []
        if joined:
            parts.append("join " + ",".join(sorted(p[-8:] for p in joined)))
        if left:
            parts.append("leave " + ",".join(sorted(p[-8:] for p in left)))
        return "; ".join(parts)
    if cur.spans != prev.spans:
        return "served ranges changed"
    for k, bw in cur.bandwidth.items():
        old = prev.bandwidth.get(k)
        if old is not None and min(bw, old) > cur.link_ceiling:
            continue
        if old is None or abs(bw - old) > cfg.link_change_threshold * max(old, 1e-9):
            return f"link {k[0][-6:]}->{k[1][-6:]} changed"
    if now - last_plan_at >= cfg.replan_period:
        return "periodic"
    return None


def build_topology(
    snap: Snapshot, ids: Sequence[str], cfg: CoordinatorConfig
) -> tuple[Topology, list[tuple[str, str]]]:
    """The planner's Topology over peers ``ids`` (node index = position in ``ids``).

    A link measured in only one direction is assumed symmetric; a pair measured in neither gets
    ``default_bandwidth``/``default_rtt`` and is returned in the defaulted list (flagged in the
    plan). Every peer is assumed reachable from clients at ``client_bandwidth``.
    """
    nodes = []
    for pid in ids:
        p = snap.peers[pid]
        thr = tuple([0.0] + list(p.throughput_decode)) if p.throughput_decode else (0.0,)
        nodes.append(NodeSpec(name=pid, gpu_type=p.device, throughput=thr, memory_bytes=float(p.weights_memory_bytes)))
    links: list[LinkSpec] = []
    defaulted: list[tuple[str, str]] = []
    for i, a in enumerate(ids):
        links.append(LinkSpec(SOURCE, i, cfg.client_bandwidth, cfg.default_rtt / 2))
        links.append(LinkSpec(i, SINK, cfg.client_bandwidth, cfg.default_rtt / 2))
        for j, b in enumerate(ids):
            if i == j:
                continue
            stat = snap.links.get((a, b)) or snap.links.get((b, a))
            if stat is None:
                if a < b:
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


def _coverage(L: int, spans) -> list[int]:
    cover = [0] * L
    for s, e in spans:
        for layer in range(s, e):
            cover[layer] += 1
    return cover


def _fill_weakest_windows(topo: Topology, placed: Mapping[int, LayerSpan], todo: Sequence[int]) -> dict[int, LayerSpan]:
    """Keep ``placed``; give each node in ``todo`` the window of its ``max_layers`` layers whose
    weakest layer has the least throughput so far (ties: least total, then lowest start)."""
    L = topo.num_layers
    out = dict(placed)
    cover = [0.0] * L
    for i, (s, e) in out.items():
        t = topo.nodes[i].throughput
        for layer in range(s, e):
            cover[layer] += t[e - s] if e - s < len(t) else 0.0
    for i in todo:
        k = min(topo.nodes[i].max_layers, L)
        if k <= 0:
            continue
        best = min(range(L - k + 1), key=lambda s: (min(cover[s : s + k]), sum(cover[s : s + k]), s))
        out[i] = (best, best + k)
        for layer in range(best, best + k):
            cover[layer] += topo.nodes[i].throughput[k]
    return out


def greedy_targets(topo: Topology, ids: Sequence[str], current: Mapping[str, LayerSpan]) -> dict[str, LayerSpan]:
    """Fallback placement for peers ``ids``, moving as few loaded layers as possible.

    1. every peer keeps its current target if it still fits (no reload);
    2. peers without one (newcomers) take the contiguous window of ``max_layers`` layers whose
       weakest layer has the least throughput so far;
    3. only if some layer is still uncovered (a departure) is everything re-placed with the
       Petals-style greedy, newcomers last -- a reload, but a model with a hole serves nothing.
    """
    L = topo.num_layers
    kept: dict[int, LayerSpan] = {}
    for i, pid in enumerate(ids):
        span = current.get(pid)
        k = topo.nodes[i].max_layers
        if span is not None and 0 <= span[0] < span[1] <= L and span[1] - span[0] <= k:
            kept[i] = tuple(span)
    out = _fill_weakest_windows(topo, kept, [i for i in range(len(ids)) if i not in kept])
    if min(_coverage(L, out.values()), default=0) == 0:
        order = [i for i in range(len(ids)) if ids[i] in current] + [i for i in range(len(ids)) if ids[i] not in current]
        out = petals_greedy(topo, order)
    return {ids[i]: span for i, span in out.items()}


def fill_idle(topo: Topology, ids: Sequence[str], targets: Mapping[str, LayerSpan]) -> dict[str, LayerSpan]:
    """Give every peer the planner left idle a replica on the weakest window (nobody else moves).

    An idle volunteer helps nobody; a replica adds capacity, KV room and a failover target.
    """
    idx = {pid: i for i, pid in enumerate(ids)}
    placed = {idx[pid]: span for pid, span in targets.items()}
    out = _fill_weakest_windows(topo, placed, [i for i, pid in enumerate(ids) if pid not in targets])
    return {**dict(targets), **{ids[i]: span for i, span in out.items() if ids[i] not in targets}}


def plan_targets(
    topo: Topology,
    ids: Sequence[str],
    current: Mapping[str, LayerSpan],
    cfg: CoordinatorConfig,
    trigger: str = "",
) -> tuple[dict[str, LayerSpan], str]:
    """Target ranges for peers ``ids`` with the planner's churn handling; returns (targets, method).

    * no current placement: a full solve (``planner.plan_for_topology``);
    * newcomers: ``churn.on_join`` (warm start, reload cost per moved layer);
    * a ``periodic`` or link-change trigger: ``churn.periodic`` (adopted only if the gain
      beats the reloads);
    * anything else (leave, served ranges or links changed): ``churn.on_leave``, which
      keeps the placement and only recomputes flows while every layer stays covered.

    Peers the planner leaves idle get a replica (:func:`fill_idle`). If the planner fails (e.g.
    the swarm is too small for the model) the greedy fallback covers what it can.
    """
    from p2pserve.placement import churn as inc
    from p2pserve.placement.planner import PlannerConfig, plan_for_topology
    from p2pserve.errors import PlanningError

    cur = {pid: tuple(span) for pid, span in current.items() if pid in set(ids)}
    try:
        pc = PlannerConfig(objective=cfg.objective, time_limit_s=cfg.solve_time_limit, seed=cfg.seed)
        reload_cost = cfg.reload_cost_per_layer
        if reload_cost is None:
            reload_cost = inc.default_reload_cost(topo, cur, pc, cfg.reload_share)
        if not cur:
            result = plan_for_topology(topo, pc)
            method = f"solve:{result.method}"
            assignments = result.assignments
        else:
            if any(pid not in cur for pid in ids):
                r = inc.on_join(topo, cur, pc, reload_cost, cfg.solve_time_limit, tolerance=cfg.churn_tolerance)
            elif trigger == "periodic" or trigger.startswith("link"):
                # measurements changed what the links can carry: adopt a fresh solve only if
                # its gain beats the cost of the layers it would reload
                r = inc.periodic(topo, cur, pc, reload_cost)
            else:
                r = inc.on_leave(topo, cur, pc, reload_cost, cfg.solve_time_limit, tolerance=cfg.churn_tolerance)
            method = f"{r.plan.method} ({r.layers_moved} layers to load)"
            assignments = r.plan.assignments
        targets = {ids[i]: (int(s), int(e)) for i, (s, e) in assignments.items() if e > s}
    except (PlanningError, ConfigError) as e:
        logger.warning(f"planner failed ({e}); using the greedy fallback")
        targets, method = greedy_targets(topo, ids, cur), "greedy-fallback"
    return fill_idle(topo, ids, targets), method


def compute_flows(snap: Snapshot, cfg: CoordinatorConfig) -> tuple[list[Flow], float, float, dict[str, LayerSpan], list]:
    """Max-flow over the ranges peers serve now: (flows, value, upper bound, spans, defaulted)."""
    spans = {pid: span for pid, span in snap.serving_now().items() if pid in set(snap.plannable())}
    ids = sorted(spans)
    if not ids:
        return [], 0.0, 0.0, {}, []
    topo, defaulted = build_topology(snap, ids, cfg)
    placement = {i: spans[pid] for i, pid in enumerate(ids)}
    result = max_flow(topo, placement)

    def name(i: int) -> str:
        return SOURCE_NAME if i == SOURCE else SINK_NAME if i == SINK else ids[i]

    flows = [Flow(name(u), name(v), float(f)) for (u, v), f in sorted(result.edge_flows.items(), key=lambda kv: (name(kv[0][0]), name(kv[0][1])))]
    return flows, float(result.value), float(topo.upper_bound()), spans, defaulted


def make_plan(
    snap: Snapshot,
    current_targets: Mapping[str, LayerSpan],
    *,
    epoch: int,
    leader_id: str,
    model: str,
    cfg: CoordinatorConfig,
    reason: str,
    now: float,
    clock: Callable[[], float] = time.perf_counter,
) -> Plan:
    """A complete Plan: targets over plannable peers, flows over served ranges."""
    t0 = clock()
    ids = snap.plannable()
    targets: dict[str, LayerSpan] = {}
    defaulted_t: list = []
    if ids:
        topo, defaulted_t = build_topology(snap, ids, cfg)
        # a peer without a target (new leader, rejoin) keeps what it already loads or serves
        current = {}
        for pid in ids:
            p = snap.peers[pid]
            span = current_targets.get(pid) or p.loading or p.serving
            if span is not None:
                current[pid] = span
        targets, method = plan_targets(topo, ids, current, cfg, reason)
        reason = f"{reason}; {method}"
    flows, value, bound, spans, defaulted_f = compute_flows(snap, cfg)
    # the bound of the *target* placement is the meaningful one: what the swarm could reach
    if ids:
        bound = max(bound, topo.upper_bound())
    defaulted = sorted(set(map(tuple, defaulted_t)) | set(map(tuple, defaulted_f)))
    return Plan(
        model=model,
        epoch=epoch,
        leader_id=leader_id,
        num_layers=cfg.num_layers,
        targets=targets,
        spans=spans,
        flows=flows,
        max_flow=value,
        upper_bound=bound,
        solve_time=clock() - t0,
        defaulted_links=defaulted,
        created_at=now,
        reason=reason,
    )


def plan_changed(old: Optional[Plan], new: Plan, rel_tol: float = 0.01) -> bool:
    """Whether ``new`` differs from ``old`` enough to deserve a new epoch."""
    if old is None:
        return True
    if old.targets != new.targets or old.spans != new.spans:
        return True
    a = {(f.src, f.dst): f.rate for f in old.flows}
    b = {(f.src, f.dst): f.rate for f in new.flows}
    if a.keys() != b.keys():
        return True
    return any(abs(a[k] - b[k]) > rel_tol * max(a[k], b[k], 1e-9) for k in a)


# ================================================================================ async shell


class CoordinatorService:
    """Runs one coordinator: candidacy every tick; when elected, plan and publish.

    ``swarm`` is a :class:`p2pserve.dht.swarm.Swarm`. ``clock`` is DHT time (epoch seconds).
    """

    def __init__(
        self,
        swarm,
        config: CoordinatorConfig,
        *,
        clock: Callable[[], float] = get_dht_time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        self.swarm = swarm
        self.config = config
        self._clock = clock
        self._sleep = sleep
        self.coordinator_id = config.coordinator_id or swarm.peer_id
        self.start_time = clock()
        self.is_leader = False
        self.plan: Optional[Plan] = None  # the plan this node last published
        self._last_summary: Optional[Summary] = None
        self._last_plan_at: Optional[float] = None
        self._last_publish_at: Optional[float] = None
        self._last_candidacy_at: Optional[float] = None
        self._latest_seen: Optional[Plan] = None  # highest-epoch trusted plan ever read
        self._peer_cache: dict[str, tuple[PeerInfo, str, float]] = {}  # id -> (info, signer, expiration)

    @property
    def tick(self) -> float:
        """Loop period."""
        return self.config.tick or self.swarm.config.candidate_refresh

    def candidacy(self) -> CoordinatorCandidate:
        """This node's candidate record."""
        return CoordinatorCandidate(
            model=self.swarm.config.model,
            coordinator_id=self.coordinator_id,
            priority=self.config.priority,
            start_time=self.start_time,
            public_key=self.swarm.public_key,
        )

    def _live_peers(self, fresh: Mapping, now: float) -> dict[str, PeerInfo]:
        """Fresh reads merged with peers seen before whose records have not expired yet.

        One DHT read can miss an entry (a slow replica, a timeout); treating that as a departure
        would move layers back and forth. A peer leaves the plan when its record expires or it
        withdraws (tombstone), not when one read misses it.
        """
        for pid, s in fresh.items():
            self._peer_cache[pid] = (s.record, s.signer, s.expiration)
        withdrawn = self.swarm.withdrawn.get(RecordKind.PEERS, set()) if hasattr(self.swarm, "withdrawn") else set()
        for pid in list(self._peer_cache):
            info, signer, exp = self._peer_cache[pid]
            if exp < now or (pid not in fresh and signer in withdrawn):
                del self._peer_cache[pid]
        return {pid: v[0] for pid, v in self._peer_cache.items()}

    async def step(self) -> Optional[str]:
        """One round; returns what was done ("published: <reason>", "refreshed", or None)."""
        now = self._clock()
        me = self.candidacy()
        if self._last_candidacy_at is None or now - self._last_candidacy_at >= self.swarm.config.candidate_refresh:
            await self.swarm.announce_candidate(me)
            self._last_candidacy_at = now
        cands = [s.record for s in await self.swarm.get_candidates()]
        if not any(c.coordinator_id == me.coordinator_id for c in cands):
            cands.append(me)  # our own record may not be readable yet
        leader = elect_leader(cands)
        grace = self.config.election_grace if self.config.election_grace is not None else self.swarm.config.candidate_ttl
        may_lead = now - self.start_time >= grace
        was_leader = self.is_leader
        self.is_leader = may_lead and leader is not None and leader.coordinator_id == self.coordinator_id
        # followers watch plans too: a new leader must publish above every epoch ever seen (the
        # old leader's record may have expired by the time it takes over) and should continue
        # from the newest placement rather than start from scratch
        plans = await self.swarm.get_plans()
        for sp in plans:
            if self._latest_seen is None or sp.plan.epoch > self._latest_seen.epoch:
                self._latest_seen = sp.plan
        if not self.is_leader:
            if was_leader:
                logger.info(f"stepping down: {leader.coordinator_id if leader else 'nobody'} leads now")
            self._last_summary = None  # take fresh decisions if leadership comes back
            return None
        peers = self._live_peers(await self.swarm.get_peers(), now)
        link_infos = [s.record for s in (await self.swarm.get_links()).values()]
        best_seen = self._latest_seen
        seen_epochs = [best_seen.epoch] if best_seen else []
        if self.plan:
            seen_epochs.append(self.plan.epoch)
        snap = Snapshot.from_records(peers, link_infos)
        summary = Summary.of(snap, self.config.activation_bytes)
        reason = None
        if not was_leader:
            reason = "elected"
        elif best_seen is not None and self.plan is not None and best_seen.epoch > self.plan.epoch:
            reason = f"saw epoch {best_seen.epoch} from {best_seen.leader_id}"
        else:
            reason = decide_replan(self._last_summary, summary, now, self._last_plan_at, self.config)
        if reason is not None:
            # continue from the newest plan anyone published (a takeover keeps the placement)
            basis = self.plan
            if best_seen is not None and (basis is None or best_seen.epoch > basis.epoch):
                basis = best_seen
            # the solve may take seconds: run it off the event loop so that the candidacy keeps
            # being refreshed meanwhile
            plan = await asyncio.to_thread(
                make_plan,
                snap,
                basis.targets if basis else {},
                epoch=0,
                leader_id=self.coordinator_id,
                model=self.swarm.config.model,
                cfg=self.config,
                reason=reason,
                now=now,
            )
            self._last_summary, self._last_plan_at = summary, now
            must_bump = reason == "elected" or reason.startswith("saw epoch")
            if must_bump or plan_changed(self.plan, plan):
                plan = _with_epoch(plan, next_epoch(seen_epochs))
                await self.swarm.publish_plan(plan)
                self.plan, self._last_publish_at = plan, now
                logger.info(
                    f"published plan epoch {plan.epoch} ({plan.reason}): {len(plan.targets)} targets, "
                    f"{len(plan.spans)} serving, max-flow {plan.max_flow:.1f} tok/s, solve {plan.solve_time * 1e3:.1f} ms"
                )
                return f"published: {reason}"
        if self.plan is not None and (self._last_publish_at is None or now - self._last_publish_at >= self.swarm.config.plan_refresh):
            await self.swarm.publish_plan(self.plan)  # same epoch: keeps the record alive
            self._last_publish_at = now
            return "refreshed"
        return None

    async def _candidacy_loop(self, stop: asyncio.Event) -> None:
        """Refresh the candidacy on its own schedule.

        Planning rounds can take a while on a loaded machine (several DHT reads, a solve); if the
        candidacy were refreshed only between rounds, a slow leader would let it lapse and lose
        the election to a follower for no reason.
        """
        while not stop.is_set():
            now = self._clock()
            if self._last_candidacy_at is None or now - self._last_candidacy_at >= self.swarm.config.candidate_refresh:
                try:
                    await self.swarm.announce_candidate(self.candidacy())
                    self._last_candidacy_at = now
                except (asyncio.TimeoutError, OSError) as e:
                    logger.warning(f"candidacy refresh failed: {e!r}")
            try:
                await asyncio.wait_for(stop.wait(), self.swarm.config.candidate_refresh / 2)
            except asyncio.TimeoutError:
                pass

    async def run(self, stop: Optional[asyncio.Event] = None) -> None:
        """Loop until ``stop`` is set; withdraw the candidacy on the way out.

        The published plan is *not* withdrawn: it stays valid until its TTL so that serving
        continues while the next candidate takes over.
        """
        stop = stop or asyncio.Event()
        candidacy = asyncio.create_task(self._candidacy_loop(stop))
        try:
            while not stop.is_set():
                try:
                    await self.step()
                except (asyncio.TimeoutError, OSError) as e:  # DHT hiccup: try again next tick
                    logger.warning(f"coordinator round failed: {e!r}")
                try:
                    await asyncio.wait_for(stop.wait(), self.tick)
                except asyncio.TimeoutError:
                    pass
        finally:
            stop.set()
            await asyncio.gather(candidacy, return_exceptions=True)
            await asyncio.shield(self.swarm.withdraw(RecordKind.COORDINATORS))


def _with_epoch(plan: Plan, epoch: int) -> Plan:
    import msgspec

    return msgspec.structs.replace(plan, epoch=epoch)
