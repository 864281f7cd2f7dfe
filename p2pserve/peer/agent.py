"""The peer's control-plane agent: announce capabilities and load, probe links, follow the plan.

State machine: joining (profiled, announced, no range) -> loading (the plan assigned a range;
reading its tensors while the old range keeps serving; once read, ``loaded`` is announced and the
peer waits until the layers it would drop are covered: make-before-break, ``handover.py``) ->
serving (flipped) -> draining (shutting down; records withdrawn). The decisions what to load and
when to flip are pure (``next_target``, ``handover_step``); the loops are a thin shell over
the swarm's records (a :class:`~p2pserve.dht.view.SwarmView`), a link prober
(:class:`~p2pserve.dht.view.LinkProbes`) and ``Peer.prepare_range`` / ``Peer.flip_to``.
"""

from __future__ import annotations

import asyncio
import logging

from p2pserve import __version__
from p2pserve import clock as clocks
from p2pserve.clock import Clock
from p2pserve.dht.announcer import Announcer
from p2pserve.dht.probe_rounds import ProbeRounds
from p2pserve.dht.records import MAX_ADDRS, MAX_STR, LatencyPoints, LinkInfo, PeerInfo, Plan
from p2pserve.dht.view import LinkProbes, SwarmView
from p2pserve.model.shard import Shard
from p2pserve.peer.handover import OtherPeer, handover_step
from p2pserve.peer.prefix_share import coarse_free
from p2pserve.peer.profiler import Profile
from p2pserve.peer.server import Peer
from p2pserve.types import LayerRange, PeerId

log = logging.getLogger(__name__)

Span = LayerRange


def next_target(plan: Plan | None, peer_id: PeerId, serving: Span | None, loading: Span | None) -> Span | None:
    """The range to start loading now, or None (no plan, no target, or already there/going)."""
    if plan is None:
        return None
    target = plan.targets.get(peer_id)
    if target is None:
        return None
    target = (int(target[0]), int(target[1]))
    if target == serving or target == loading:
        return None
    return target


def announceable(maddrs: list[str]) -> list[str]:
    """The addresses a PeerInfo can carry: the first ``MAX_ADDRS`` within ``MAX_STR`` characters
    (a host with many interfaces must not make its record refused, which would withdraw it)."""
    return [m for m in maddrs if len(m) <= MAX_STR][:MAX_ADDRS]


class SwarmAgent:
    """Connects one running ``Peer`` to the swarm's control plane.

    ``wall`` stamps announcements (DHT time); ``monotonic`` times loads and handovers.
    """

    def __init__(self, peer: Peer, swarm: SwarmView, profile: Profile, follow_plan: bool,
                 prober: LinkProbes | None = None, *, wall: Clock = clocks.wall, monotonic: Clock = clocks.monotonic):
        self.peer = peer
        self.swarm = swarm
        self.profile = profile
        self.follow_plan = follow_plan
        self.prober = prober
        self._wall = wall
        self._monotonic = monotonic
        self.loading: Span | None = None
        self.loaded = False  # the loading range is in memory, waiting for the handover
        self.retiring = False  # announced as draining while still serving (a machine agent regroups)
        self.state = "joining" if peer.served is None else "serving"
        self.announcer = Announcer(swarm, self.peer_info, self.link_info if prober else None)
        self._tasks: list[asyncio.Task] = []

    def peer_info(self) -> PeerInfo:
        """This peer's current announcement."""
        spec = self.peer.spec
        budget = self.peer.table.budget
        served = self.peer.served
        layers_held = max(1, (served[1] - served[0]) if served else 1)
        return PeerInfo(
            model=self.swarm.config.model,
            peer_id=self.swarm.peer_id,
            addrs=announceable(self.peer.visible_maddrs()),
            device=self.profile.device,
            weights_memory_bytes=self.profile.max_layers * spec.layer_bytes,
            kv_memory_bytes=budget.capacity * spec.kv_bytes_per_token_layer,
            dtype=spec.dtype,
            throughput_decode=list(self.profile.decode),
            throughput_prefill=list(self.profile.prefill),
            max_layers=self.profile.max_layers,
            serving=served,
            loading=self.loading,
            loaded=self.loaded,
            state="draining" if self.peer.stuck or self.retiring else self.state,
            kv_free_tokens=coarse_free(budget.free, budget.capacity, self.peer.config.admission.prefix_sharing)
            // layers_held,
            queued_tokens=self.peer.worker.queued_tokens,
            version=__version__,
            timestamp=self._wall(),
            reply_key=self.peer.handler.signer.public_text,
            num_layers=spec.num_layers,
            activation_bytes=spec.activation_bytes_per_token,
            quant=spec.quant or "",
            tp=self.peer.tp.config.world if self.peer.tp is not None else 1,
            latency=LatencyPoints(prompt=list(self.profile.prompt_ms), decode=list(self.profile.decode_ms))
            if self.profile.prompt_ms and self.profile.decode_ms else None,
            kv_entry_bytes=spec.kv_bytes_per_token_layer,
            model_id=spec.model_id,
        )

    def link_info(self) -> LinkInfo | None:
        """Links measured so far (None until the first probe)."""
        if not self.prober or not self.prober.results:
            return None
        return LinkInfo(model=self.swarm.config.model, peer_id=self.swarm.peer_id,
                        links=dict(self.prober.results), timestamp=self._wall())

    async def start(self) -> None:
        """Start announcing, probing and (if plan-driven) following the plan."""
        if self.prober:
            await self.prober.start()
            self._tasks.append(asyncio.create_task(self._probe_loop()))
        self._tasks.append(asyncio.create_task(self.announcer.run()))
        if self.follow_plan:
            self._tasks.append(asyncio.create_task(self._plan_loop()))

    def retire(self) -> None:
        """Announce draining but keep serving (SIGUSR1 of ``p2pserve peer``): the plan moves the
        layers elsewhere while this peer still answers; a machine agent stops it once they are
        served (make-before-break of a regroup, ``machine/agent.py``)."""
        self.retiring = True
        self.announcer.poke()

    async def _plan_loop(self) -> None:
        period = max(0.2, self.swarm.config.plan_refresh / 2)
        while True:
            if self.retiring:
                await asyncio.sleep(period)
                continue
            try:
                signed = await self.swarm.get_plan()
                plan = signed.plan if signed else None
                target = next_target(plan, self.swarm.peer_id, self.peer.served, self.loading)
                if target is not None:
                    await self._move(target)
            except asyncio.CancelledError:
                raise
            except Exception:  # a DHT hiccup or a failed load must not stop the peer
                log.exception("plan follower step failed; retrying")
            await asyncio.sleep(period)

    async def _move(self, target: Span) -> None:
        self.loading, self.state = target, "loading"
        self.announcer.poke()
        t = self._monotonic()
        log.info("plan assigns layers [%d, %d): loading", *target)
        try:
            shard = await self.peer.prepare_range(*target)
            self.loaded = True
            self.announcer.poke()
            if await self._handover(target, shard):
                self.peer.flip_to(shard)
                log.info("now serving [%d, %d) after %.1f s", *target, self._monotonic() - t)
        finally:
            self.loading, self.loaded = None, False
            self.state = "serving" if self.peer.served else "joining"
            self.announcer.poke()

    async def _handover(self, target: Span, shard: Shard) -> bool:
        """Wait until dropping the old range leaves no layer unserved (within limits); False if
        the plan moved this peer elsewhere meanwhile (the loaded shard is then discarded), unless
        layers of it are served by nobody else (a partner of a swap flipped counting on it).
        In a swap, this peer may first serve its old and new ranges at once (a bridge)."""
        cfg = self.swarm.config
        period = max(0.1, min(cfg.peer_refresh, cfg.plan_refresh) / 2)
        t0 = self._monotonic()
        last_reason = None
        while True:
            peers = await self.swarm.get_peers()
            signed = await self.swarm.get_plan()
            targets = signed.plan.targets if signed is not None else {}
            # a loading peer still serves its old range; a draining one is about to stop
            others = [OtherPeer(s.record.serving, s.record.loading, s.record.loaded, targets.get(pid), s.record.tp)
                      for pid, s in peers.items() if pid != self.swarm.peer_id and s.record.state != "draining"]
            now_target = targets.get(self.swarm.peer_id)
            moved = now_target is not None and tuple(now_target) != target
            step, reason = handover_step(self.peer.served, target, others, moved, self._monotonic() - t0,
                                         grace_s=cfg.plan_refresh, settle_s=cfg.peer_refresh,
                                         max_wait_s=cfg.handover_max_wait, can_bridge=self.peer.tp is None)
            if step == "drop":
                log.info("%s; dropping [%d, %d)", reason, *target)
                return False
            if reason != last_reason:
                log.info("handover to [%d, %d): %s", *target, reason)
                last_reason = reason
            if step == "flip":
                return True
            if step == "bridge":
                both = await self.peer.bridge(shard)
                if both is not None:  # None: a TP group, or the ranges leave a gap: keep waiting
                    self.peer.flip_to(both)
                    self.announcer.poke()
                    continue
            await asyncio.sleep(period)

    async def _probe_loop(self) -> None:
        period = max(0.5, min(self.swarm.config.link_refresh, self.prober.config.min_interval_s) / 2)
        rounds = ProbeRounds(self.swarm, self.prober, wall=self._wall)
        while True:
            try:
                if await rounds.step():  # the prober's results hold them: announce now
                    self.announcer.poke_links()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("link probing failed; retrying")
            await asyncio.sleep(period)

    async def shutdown(self) -> None:
        """Announce draining, stop the loops and withdraw our records."""
        self.state = "draining"
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)  # the announcer withdraws on exit
        if self.prober:
            try:
                await self.prober.stop()
            except Exception:
                pass
