"""The coordinator service: election candidate; when leader, plans and publishes.

A thin async shell over the swarm (a :class:`~p2pserve.dht.view.SwarmView`): each round it refreshes
its candidacy, reads candidacies, plans and peers, and hands a :class:`~p2pserve.coordinator.snapshot.Snapshot`
to the pure :func:`~p2pserve.coordinator.replan.replan`, then publishes what that decided. Who leads is
:func:`p2pserve.dht.election.elect_leader`; what the plan holds is ``replan``'s business.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from dataclasses import replace
from typing import Awaitable, Callable, Optional

from p2pserve import clock as clocks
from p2pserve.clock import Clock
from p2pserve.config import CoordinatorConfig
from p2pserve.errors import ConfigError
from p2pserve.coordinator.exclusion import ExclusionBook, judge
from p2pserve.coordinator import claims
from p2pserve.coordinator.compute_probe import ComputeProber
from p2pserve.coordinator.retrial import Retrials
from p2pserve.coordinator.replan import Decision, LeaderState, replan
from p2pserve.coordinator.shape import Shape, agree, mismatched
from p2pserve.coordinator.snapshot import Snapshot
from p2pserve.dht.live_peers import LivePeers
from p2pserve.coordinator.groupings import GroupingPolicy, choose_groupings
from p2pserve.dht.election import elect_leader, next_epoch
from p2pserve.dht.machine_info import MachineInfo
from p2pserve.dht.evidence import Evidence
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.records import CoordinatorCandidate, PeerInfo, Plan
from p2pserve.dht.reports import ServiceReports
from p2pserve.dht.view import SwarmView
from p2pserve.metrics import CoordinatorMetrics
from p2pserve.placement.guard import CheckFactory

logger = logging.getLogger(__name__)


def key_text(key: str) -> str:
    """An OpenSSH public key in its normalized form (other text, e.g. a peer id, as is)."""
    from p2pserve.dht.signing import normalize_public_key

    try:
        return normalize_public_key(key) if key.startswith("ssh-") else key
    except ConfigError:
        return key


def verifier_set(entries) -> frozenset[str]:
    """``CoordinatorConfig.trusted_verifiers`` normalized: public keys and peer ids."""
    return frozenset(key_text(e.strip()) for e in entries)


class CoordinatorService:
    """Runs one coordinator: candidacy every tick; when elected, plan and publish.

    ``clock`` is DHT time (epoch seconds, :func:`p2pserve.clock.wall`).
    """

    def __init__(
        self,
        swarm: SwarmView,
        config: CoordinatorConfig,
        *,
        clock: Clock = clocks.wall,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        shape: Optional[Shape] = None,
        prober: Optional[ComputeProber] = None,
        retrials: Optional[Retrials] = None,
        plan_check: Optional[CheckFactory] = None,
    ):
        self.swarm = swarm
        self.config = config
        # peers announcing another shape than this are left out of the plan (None: no check;
        # readers knowing num_layers drop other depths anyway)
        self.shape = shape
        # builds the publish guard's check from each round's topology (None: no guard)
        self.plan_check = plan_check
        self.shape_refused: dict[str, str] = {}  # of the last round, by peer id
        self._clock = clock
        self._sleep = sleep
        self.coordinator_id = config.coordinator_id or swarm.peer_id
        self.start_time = clock()
        self.is_leader = False
        self._state = LeaderState()
        self._last_publish_at: Optional[float] = None
        self._last_candidacy_at: Optional[float] = None
        self._latest_seen: Optional[Plan] = None  # highest-epoch trusted plan ever read
        self._peers = LivePeers()
        self._peers_read_at: Optional[float] = None  # when the peers were last read (leader or not)
        self.exclusions = ExclusionBook(config.exclusion_s)
        self.verdicts: dict[str, claims.Verdict] = {}  # of the last round, by peer id
        self.prober = prober  # the leader's own compute probes (coordinator/compute_probe.py), if any
        self._probe_targets: dict = {}  # the peers of the last snapshot, which the prober measures
        # re-executes accused steps before excluding anyone (coordinator/retrial.py); None: only
        # trusted verifiers' cases exclude
        self.retrials = retrials
        self.metrics = CoordinatorMetrics()  # served by `p2pserve coordinator --metrics-port`
        self.grouping = GroupingPolicy.parse(str(config.grouping))  # a bad --grouping fails at start

    @property
    def plan(self) -> Optional[Plan]:
        """The plan this node last published."""
        return self._state.plan

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

    async def _refresh_candidacy(self, now: float) -> None:
        if self._last_candidacy_at is None or now - self._last_candidacy_at >= self.swarm.config.candidate_refresh:
            await self.swarm.announce_candidate(self.candidacy())
            self._last_candidacy_at = now

    async def _elect(self, now: float) -> Optional[CoordinatorCandidate]:
        """Update ``is_leader`` from the live candidacies; returns the leader."""
        me = self.candidacy()
        cands = [s.record for s in await self.swarm.get_candidates()]
        if not any(c.coordinator_id == me.coordinator_id for c in cands):
            cands.append(me)  # our own record may not be readable yet
        leader = elect_leader(cands)
        grace = self.config.election_grace if self.config.election_grace is not None else self.swarm.config.candidate_ttl
        may_lead = now - self.start_time >= grace
        self.is_leader = may_lead and leader is not None and leader.coordinator_id == self.coordinator_id
        return leader

    async def _watch_plans(self) -> None:
        # followers watch plans too: a new leader must publish above every epoch ever seen (the
        # old leader's record may have expired by the time it takes over) and should continue
        # from the newest placement rather than start from scratch
        for sp in await self.swarm.get_plans():
            if self._latest_seen is None or sp.plan.epoch > self._latest_seen.epoch:
                self._latest_seen = sp.plan

    async def _live_peers(self, now: float) -> dict[str, PeerInfo]:
        """One read of the peers, merged into what the reads before saw (``LivePeers``)."""
        live = await self._peers.read(self.swarm, now)
        self._peers_read_at = now
        return live

    async def _follow_peers(self, now: float) -> None:
        """A follower reads the peers too (once per ``peer_refresh``): taking the lead, it plans from
        a merged view, not one first read that may miss a serving peer (and route around it)."""
        if self._peers_read_at is None or now - self._peers_read_at >= self.swarm.config.peer_refresh:
            await self._live_peers(now)

    async def _snapshot(self, now: float) -> Snapshot:
        # both reads at once: at a few hundred peers each is a DHT get of hundreds of records
        peers, links = await asyncio.gather(self._live_peers(now), self.swarm.get_links())
        peers = await self._without_excluded(self._with_shape(peers), now)
        self._probe_targets = peers
        link_infos = [s.record for s in links.values()]
        return await self._police(Snapshot.from_records(peers, link_infos))

    def _with_shape(self, peers: dict) -> dict:
        """``peers`` less those announcing another model shape (``coordinator/shape.py``)."""
        if self.shape is None:
            return peers
        refused = mismatched(peers, self.shape)
        for pid, reason in refused.items():
            if self.shape_refused.get(pid) != reason:  # once per change, not every round
                logger.warning(f"leaving peer {pid} out of the plan: {reason}")
        self.shape_refused = refused
        return {pid: info for pid, info in peers.items() if pid not in refused}

    async def _police(self, snap: Snapshot) -> Snapshot:
        """Claims capped by observed service rates, peers capped per address (coordinator/claims.py)."""
        cfg = self.config
        if not cfg.check_claims and not cfg.max_peers_per_address:
            return snap
        reports = [s.record for s in await self.swarm.read(RecordKind.REPORTS, ServiceReports)] if cfg.check_claims else []
        trusted = frozenset()
        if self.prober is not None:  # its own probes, fresher than their copy in the DHT; trusted
            me = self.swarm.peer_id
            reports = [r for r in reports if r.reporter_id != me] + [self.prober.report(me, self.swarm.config.model, [])]
            trusted = frozenset({me})
        snap, found = claims.police(snap, reports, cfg, trusted)
        for pid, v in found.items():
            prev = self.verdicts.get(pid)
            if v.capped and (prev is None or (prev.reason, prev.capped) != (v.reason, v.capped)):
                logger.info(f"peer {pid}: {v.describe()}")  # once per change, not every round
        self.verdicts = found
        return snap

    async def _without_excluded(self, peers: dict, now: float) -> dict:
        """``peers`` less those that verified evidence excludes (``coordinator/exclusion.py``)."""
        try:
            evidence = await self.swarm.read(RecordKind.EVIDENCE, Evidence)
        except (asyncio.TimeoutError, OSError) as e:  # keep the exclusions in force
            logger.warning(f"reading evidence failed: {e!r}")
            evidence = []
        trusted = verifier_set(self.config.trusted_verifiers) if self.config.trust_verifiers else frozenset()
        excluded = frozenset(self.exclusions.verdicts)
        findings = judge(evidence, peers, lambda signer, reporter: key_text(signer) in trusted or reporter in trusted,
                         excluded)
        found = dict(findings.convicted)
        if self.retrials is not None and findings.accused:  # an accusation is a reason to look
            found.update(await self.retrials.convictions(findings.accused, peers, excluded | found.keys()))
        for peer, reason in found.items():
            if peer not in self.exclusions.verdicts:
                logger.warning(f"excluding peer {peer}: {reason}")
        verdicts = self.exclusions.update(now, found)
        return {pid: info for pid, info in peers.items() if pid not in verdicts}

    async def step(self) -> Optional[str]:
        """One round; returns what was done ("published: <reason>", "refreshed", or None)."""
        now = self._clock()
        await self._refresh_candidacy(now)
        was_leader = self.is_leader
        leader = await self._elect(now)
        await self._watch_plans()
        self.metrics.leader.set(1 if self.is_leader else 0)
        if self._latest_seen is not None:
            self.metrics.seen_epoch.set(self._latest_seen.epoch)
        if not self.is_leader:
            if was_leader:
                logger.info(f"stepping down: {leader.coordinator_id if leader else 'nobody'} leads now")
            self._state = replace(self._state, summary=None)  # take fresh decisions if leadership comes back
            await self._follow_peers(now)
            return None
        snap = await self._snapshot(now)
        # the solve may take seconds: run it off the event loop so that the candidacy keeps
        # being refreshed meanwhile
        decision = await asyncio.to_thread(
            replan, snap, self._state, elected=not was_leader, latest_seen=self._latest_seen, now=now,
            cfg=self.config, leader_id=self.coordinator_id, model=self.swarm.config.model,
            plan_check=self.plan_check,
        )
        self._state = decision.state
        decision = await self._with_groupings(decision, snap)
        if decision.solve_s is not None:
            self.metrics.solve_seconds.observe(decision.solve_s)
        if decision.publish is not None:
            await self._publish(decision, now)
            return f"published: {decision.reason}"
        if self.plan is not None and (self._last_publish_at is None or now - self._last_publish_at >= self.swarm.config.plan_refresh):
            await self.swarm.publish_plan(self.plan)  # same epoch: keeps the record alive
            self._last_publish_at = now
            return "refreshed"
        return None

    async def _with_groupings(self, decision: Decision, snap: Snapshot) -> Decision:
        """``decision`` with the machine agents' groupings in its plan; a change of grouping alone
        publishes the current plan under a new epoch (``coordinator/groupings.py``)."""
        try:
            machines = {s.record.machine_id: s.record for s in await self.swarm.read(RecordKind.MACHINES, MachineInfo)}
        except (asyncio.TimeoutError, OSError) as e:  # keep the groupings in force
            logger.warning(f"reading machine agents failed: {e!r}")
            return decision
        if not machines and (self.plan is None or not self.plan.groupings):
            return decision
        cfg = self.config
        groupings = await asyncio.to_thread(choose_groupings, machines, snap.peers, cfg.num_layers,
                                            cfg.activation_bytes or 1, self.grouping)
        if decision.publish is not None:
            plan = msgspec.structs.replace(decision.publish, groupings=groupings)
        elif self.plan is not None and groupings != self.plan.groupings:
            seen = [self.plan.epoch] + ([self._latest_seen.epoch] if self._latest_seen else [])
            plan = msgspec.structs.replace(self.plan, groupings=groupings, epoch=next_epoch(seen, self._clock()),
                                           reason="machine groupings changed")
            logger.info(f"machine groupings: {groupings}")
        else:
            return decision
        self._state = replace(self._state, plan=plan)
        return replace(decision, state=self._state, publish=plan)

    async def _publish(self, decision: Decision, now: float) -> None:
        plan = decision.publish
        assert plan is not None, "only a decision with a plan to publish is published"
        await self.swarm.publish_plan(plan)
        self._last_publish_at = now
        m = self.metrics
        m.epoch.set(plan.epoch)
        m.max_flow.set(plan.max_flow)
        m.serving.set(len(plan.spans))
        m.published.labels(decision.reason.trigger.name.lower() if decision.reason else "unknown").inc()
        logger.info(
            f"published plan epoch {plan.epoch} ({plan.reason}): {len(plan.targets)} targets, "
            f"{len(plan.spans)} serving, max-flow {plan.max_flow:.1f} tok/s, solve {plan.solve_time * 1e3:.1f} ms"
        )

    async def _candidacy_loop(self, stop: asyncio.Event) -> None:
        """Refresh the candidacy on its own schedule.

        Planning rounds can take a while on a loaded machine (several DHT reads, a solve); if the
        candidacy were refreshed only between rounds, a slow leader would let it lapse and lose
        the election to a follower for no reason.
        """
        while not stop.is_set():
            try:
                await self._refresh_candidacy(self._clock())
            except (asyncio.TimeoutError, OSError) as e:
                logger.warning(f"candidacy refresh failed: {e!r}")
            except Exception:  # keep the candidacy loop alive whatever one refresh hit
                logger.exception("candidacy refresh failed; trying again")
            try:
                await asyncio.wait_for(stop.wait(), self.swarm.config.candidate_refresh / 2)
            except asyncio.TimeoutError:
                pass

    async def _probe_loop(self, stop: asyncio.Event) -> None:
        """While leading, probe the peers' compute and publish what was measured (its own signed
        ``ServiceReports``, which ``p2pserve status`` reads to say why a claim is capped)."""
        prober = self.prober
        assert prober is not None, "the probe loop runs only with a prober"
        while not stop.is_set():
            try:
                if self.is_leader and await prober.round(self._probe_targets, stop):
                    await self.swarm.announce(RecordKind.REPORTS, prober.report(self.swarm.peer_id,
                                                                               self.swarm.config.model, []))
            except (asyncio.TimeoutError, OSError) as e:
                logger.warning(f"compute probes: {e!r}")
            except Exception:  # keep probing whatever one round hit
                logger.exception("compute probe round failed; trying again")
            try:
                await asyncio.wait_for(stop.wait(), self.tick)
            except asyncio.TimeoutError:
                pass

    async def run(self, stop: Optional[asyncio.Event] = None) -> None:
        """Loop until ``stop`` is set; withdraw the candidacy on the way out.

        The published plan is *not* withdrawn: it stays valid until its TTL so that serving
        continues while the next candidate takes over.
        """
        stop = stop or asyncio.Event()
        candidacy = asyncio.create_task(self._candidacy_loop(stop))
        probing = asyncio.create_task(self._probe_loop(stop)) if self.prober is not None else None
        try:
            while not stop.is_set():
                try:
                    await self.step()
                except (asyncio.TimeoutError, OSError) as e:  # DHT hiccup: try again next tick
                    self.metrics.failed_rounds.inc()
                    logger.warning(f"coordinator round failed: {e!r}")
                except Exception:  # one bad round (a hostile record, a bug) must not end the service
                    self.metrics.failed_rounds.inc()
                    logger.exception("coordinator round failed; trying again next tick")
                try:
                    await asyncio.wait_for(stop.wait(), self.tick)
                except asyncio.TimeoutError:
                    pass
        finally:
            stop.set()
            await asyncio.gather(candidacy, *([probing] if probing else []), return_exceptions=True)
            if self.prober is not None:
                await self.prober.close()
            await asyncio.shield(self.swarm.withdraw(RecordKind.COORDINATORS))


async def learn_shape(swarm: SwarmView, stop: asyncio.Event, period: float, settle: float, *,
                      log_every: float = 10.0, clock: Clock = clocks.monotonic) -> Optional[Shape]:
    """Read the peers' records until their announcements agree on the model's shape
    (:func:`~p2pserve.coordinator.shape.agree`) and the same shape has won every read for
    ``settle`` seconds (so that peers starting together are all counted, not the first one
    heard); None if ``stop`` is set first.

    Logs what it waits for when that changes and at least every ``log_every`` seconds, and the
    peers whose conflicting announcements it refuses.
    """
    said, said_at, leading, since = None, 0.0, None, 0.0
    while not stop.is_set():
        try:
            verdict = agree({pid: s.record for pid, s in (await swarm.get_peers()).items()})
        except (asyncio.TimeoutError, OSError) as e:  # DHT hiccup: read again next period
            logger.warning(f"reading peers for the model's shape failed: {e!r}")
            verdict = None
        if verdict is not None:
            now = clock()
            if verdict.shape != leading:
                leading, since = verdict.shape, now
            if leading is not None and now - since >= settle:
                for pid, reason in verdict.refused.items():
                    logger.warning(f"refusing peer {pid}'s shape: {reason}")
                logger.info(f"model shape from the peers' announcements: {verdict.reason}")
                return leading
            if verdict.reason != said or now - said_at >= log_every:
                logger.info(f"waiting for the model's shape: {verdict.reason}")
                said, said_at = verdict.reason, now
        try:
            await asyncio.wait_for(stop.wait(), period)
        except asyncio.TimeoutError:
            pass
    return None
