"""The fault driver: at seeded random moments it SIGKILLs a peer (restarted a little later as a
new process), freezes one with SIGSTOP (SIGCONT later: a hung peer, which only the clients' hop
timeout detects), or kills the elected coordinator (restarted later, with its key).

The rule that keeps the model coverable: a peer fault is injected only if, without the victim,
the *healthy* peers' served ranges still hold every layer, and at most ``max_down`` slots are
unhealthy afterwards. Healthy means: running, not frozen, not due for a recovery, and answered
``GetStats`` recently with a served range. The clients' own bans are not consulted: the swarm
can serve, and coping with a ban that outlives a hang is the client's failover's job. A
coordinator is killed only while every coordinator runs and is a live candidate, so there is
always one to take over.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from tests.chaos.swarm import covered

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FaultConfig:
    """Seeded pacing and bounds of the faults."""

    seed: int = 0
    max_down: int = 2
    gap_s: tuple[float, float] = (0.5, 1.5)  # between two fault attempts
    # A killed peer's slot stays unhealthy for its whole restart (a new process, a plan slot, a
    # load: 20-40 s on a loaded machine), a frozen one for seconds: kills are drawn less often.
    weights: tuple[tuple[str, float], ...] = (("kill_peer", 1.0), ("stop_peer", 3.0), ("kill_leader", 1.5))
    restart_after_s: tuple[float, float] = (1.0, 4.0)  # a killed peer's new process starts after this
    stop_for_s: tuple[float, float] = (3.5, 5.0)  # frozen longer than the clients' 3 s hop timeout
    coordinator_restart_after_s: tuple[float, float] = (1.0, 3.0)
    fresh_s: float = 4.0  # a GetStats answer older than this does not make a peer healthy


class FaultDriver:
    """Injects faults into ``swarm`` (a :class:`~tests.chaos.swarm.LocalSwarm`).

    ``poller`` is the :class:`~tests.chaos.monitor.StatsPoller` the driver keeps fed.
    """

    def __init__(self, swarm, poller, config: FaultConfig = FaultConfig()):
        self.swarm = swarm
        self.poller = poller
        self.config = config
        self.rng = random.Random(config.seed)
        self.t0 = time.monotonic()
        self.injected: Counter = Counter()
        self.skipped: Counter = Counter()
        self.events: list[dict] = []
        self.skip_log: list[dict] = []  # the healthy ranges when a peer fault had to be skipped
        self._pending: dict[str, tuple[float, Callable]] = {}  # member -> (due time, recovery action)

    @property
    def total(self) -> int:
        return sum(self.injected.values())

    # ----------------------------------------------------------------------------- health

    def healthy(self) -> dict[str, tuple[int, int]]:
        """Healthy peer slots and the ranges they serve (see the module docstring)."""
        out = {}
        for slot, child in self.swarm.slots.items():
            if slot in self.swarm.down or slot in self.swarm.paused or slot in self._pending:
                continue
            addr = self.swarm.peer_addr(slot)
            span = self.poller.served(child.name, self.config.fresh_s)
            if addr is not None and span is not None:
                out[slot] = span
        return out

    def eligible_peers(self) -> list[str]:
        """Slots that may be faulted now without breaking the coverage rule."""
        healthy = self.healthy()
        if len(self.swarm.slots) - len(healthy) >= self.config.max_down:
            return []
        L = self.swarm.spec.num_layers
        return [s for s in healthy if covered([span for o, span in healthy.items() if o != s], L)]

    # ----------------------------------------------------------------------------- loop

    async def run(self, stop: asyncio.Event) -> None:
        """Inject faults until ``stop`` is set, then recover every member at once."""
        lo, hi = self.config.gap_s
        try:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), self.rng.uniform(lo, hi))
                except TimeoutError:
                    pass
                await self._recover_due()
                if not stop.is_set():
                    await self._attempt()
        finally:
            for member in list(self._pending):
                await self._recover(member)

    async def _attempt(self) -> None:
        kinds, weights = zip(*self.config.weights)
        # every kind once first (while the swarm is whole, each is sure to be allowed), then at random
        kind = next((k for k in kinds if not self.injected[k]), None) or self.rng.choices(kinds, weights)[0]
        if kind == "kill_leader":
            await self._kill_leader()
            return
        eligible = self.eligible_peers()
        if not eligible:
            self.skipped[f"{kind}: would break the coverage rule"] += 1
            if len(self.skip_log) < 40:
                self.skip_log.append({"t": round(time.monotonic() - self.t0, 1), "healthy": {
                    self.swarm.slots[s].name: span for s, span in self.healthy().items()}})
            return
        slot = self.rng.choice(sorted(eligible))
        peer_id = self.swarm.peer_addr(slot)[0]
        name = self.swarm.slots[slot].name
        if kind == "kill_peer":
            await asyncio.to_thread(self.swarm.kill, slot)
            await self.poller.forget(name)
            self._schedule(slot, self.config.restart_after_s, lambda s=slot: self.swarm.restart(s))
        else:
            await asyncio.to_thread(self.swarm.pause, slot)
            self._schedule(slot, self.config.stop_for_s, lambda s=slot: self.swarm.resume(s))
        self._record(kind, name, peer_id)

    async def _kill_leader(self) -> None:
        # every coordinator must be a live candidate (a restarted one that has not announced
        # itself yet could not take over): there is then always one to take over
        candidates = {c.record.coordinator_id for c in await self.swarm.observer.get_candidates()}
        if any(c in self.swarm.down for c in self.swarm.coords) or not set(self.swarm.coords) <= candidates:
            self.skipped["kill_leader: not every coordinator is a live candidate"] += 1
            return
        plan, _ = await self.swarm.view()
        leader = plan.leader_id if plan is not None else None
        if leader not in self.swarm.coords:
            self.skipped["kill_leader: no plan from a known coordinator"] += 1
            return
        name = self.swarm.coords[leader].name
        await asyncio.to_thread(self.swarm.kill, leader)
        self._schedule(leader, self.config.coordinator_restart_after_s, lambda c=leader: self.swarm.restart(c))
        self._record("kill_leader", name, f"epoch {plan.epoch}")

    def _record(self, kind: str, name: str, detail: str) -> None:
        self.injected[kind] += 1
        self.events.append({"t": round(time.monotonic() - self.t0, 1), "kind": kind, "process": name,
                            "detail": detail})
        log.info("fault %d: %s %s (%s)", self.total, kind, name, detail)

    def _schedule(self, member: str, delay: tuple[float, float], action: Callable) -> None:
        self._pending[member] = (time.monotonic() + self.rng.uniform(*delay), action)

    async def _recover_due(self) -> None:
        now = time.monotonic()
        for member, (due, _) in list(self._pending.items()):
            if due <= now:
                await self._recover(member)

    async def _recover(self, member: str) -> None:
        _, action = self._pending.pop(member)
        await asyncio.to_thread(action)
