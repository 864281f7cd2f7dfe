"""The chaos run, shared by ``tests/chaos/test_chaos.py`` (CI) and ``benchmarks/chaos.py`` (long runs).

One asyncio loop in this process drives everything against real processes
(:class:`~tests.chaos.swarm.LocalSwarm`: a bootstrap node, two coordinators, five plan-driven
peers on a seeded tiny fp32 Llama):

* chat workers (:mod:`tests.chaos.clients`) chat continuously through ``AsyncClient``s, every
  reply checked against ``transformers`` ``generate``;
* the fault driver (:mod:`tests.chaos.faults`) kills, freezes and restarts peers and kills the
  elected coordinator;
* the hostile participant (:mod:`tests.chaos.hostile`) attacks healthy peers;
* the monitor polls every live peer's ``GetStats`` (served range for the fault rule, and the
  compute thread's health) and samples their RSS and open fds (:mod:`tests.chaos.monitor`).

The chaos phase lasts until at least ``min_chaos_s`` passed *and* ``min_faults`` faults were
injected (bounded by ``max_chaos_s``); then faults and attacks stop, frozen peers are woken,
killed members restarted, and the chat requests in flight finish. :func:`run_chaos` returns the
report as a dict (see ``benchmarks/chaos.py`` for what each figure means).

Why the chat workers share two ``AsyncClient`` nodes rather than one each: every swarm client
is a hivemind DHT process plus a go-libp2p daemon, and eight of them would take a large share
of the two shared cores from the peers under test. Two nodes still give two independent ban
lists and swarm views (a gateway serving many users is one node); each request still gets its
own pipeline, route and failover.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from p2pserve.client.api import AsyncClient
from p2pserve.client.node import client_transport
from p2pserve.config import ClientConfig
from tests.chaos.clients import ClientTally, build_conversations, chat_worker
from tests.chaos.faults import FaultConfig, FaultDriver
from tests.chaos.hostile import Hostile
from tests.chaos.monitor import ProcessSampler, StatsPoller, fd_kinds, sockets
from tests.chaos.swarm import LocalSwarm, SwarmSpec, build_model

log = logging.getLogger(__name__)

#: The chat clients' config: a short hop timeout (a frozen peer costs a request ~3 s, not 60),
#: more pipeline rebuilds per step than the default 3 (under chaos one step can meet a dead
#: peer, a stale range and a frozen one in a row), short bans (peers come back quickly), and up
#: to 10 s of waiting for a route when none is usable (default 0: fail at once with 503).
CHAOS_CLIENT = ClientConfig(hop_timeout_s=3.0, connect_timeout_s=3.0, max_retries=8, ban_base_s=2.0, ban_max_s=8.0,
                            no_route_wait_s=10.0)


@dataclass
class ChaosConfig:
    """Everything one chaos run needs; the defaults are the CI test's."""

    workdir: Path
    min_chaos_s: float = 60.0
    min_faults: int = 20
    max_chaos_s: float = 180.0
    clients: int = 8
    client_nodes: int = 2
    max_new_tokens: int = 24
    seed: int = 0
    spec: SwarmSpec = field(default_factory=SwarmSpec)
    faults: FaultConfig = field(default_factory=FaultConfig)
    client_config: ClientConfig = CHAOS_CLIENT
    request_deadline_s: float = 120.0  # a request running longer is counted lost (a stuck client)
    attack_gap_s: tuple[float, float] = (0.5, 1.5)
    stats_period_s: float = 1.0
    rss_period_s: float = 5.0


class Chaos:
    """One run: the swarm, its clients, and the tasks that fault, attack and watch it."""

    def __init__(self, cfg: ChaosConfig):
        self.cfg = cfg
        self.swarm: LocalSwarm | None = None
        self.clients: list[AsyncClient] = []
        self.tally = ClientTally()
        self.sampler = ProcessSampler()
        self.poller: StatsPoller | None = None
        self.faults: FaultDriver | None = None
        self.hostile: Hostile | None = None
        self.timeline: dict[str, float] = {}
        self._transports: list = []
        self._tasks: list[asyncio.Task] = []
        self._t0 = time.monotonic()

    def _mark(self, what: str) -> None:
        self.timeline[what] = round(time.monotonic() - self._t0, 1)
        log.info("chaos: %s at %.1f s", what, self.timeline[what])

    # ----------------------------------------------------------------------------- setup

    async def setup(self) -> list:
        """Start the swarm and the clients; returns the conversations (references computed)."""
        cfg = self.cfg
        logdir = Path(cfg.workdir) / "logs"
        logdir.mkdir(parents=True, exist_ok=True)
        path = await asyncio.to_thread(build_model, Path(cfg.workdir), cfg.spec.num_layers)
        self.swarm = LocalSwarm(logdir, path, cfg.spec)
        await asyncio.to_thread(self.swarm.start)
        self._mark("every peer started")
        await self.swarm.wait_serving()
        self._mark("every layer served")
        model = self.swarm.model
        conversations = await asyncio.to_thread(build_conversations, model, path, cfg.max_new_tokens)
        for i in range(cfg.client_nodes):
            client = AsyncClient(model=path, dht_config=self.swarm.dht_config(), config=cfg.client_config,
                                 seed=cfg.seed * 100 + i, model_info=model)
            self.clients.append(await client.start())
        for client in self.clients:  # setup, not chaos: wait until each client sees a route
            await _first_reply(client, conversations[0])
        monitor_t, hostile_t = await client_transport(ClientConfig()), await client_transport(ClientConfig())
        self._transports = [monitor_t, hostile_t]
        self.poller = StatsPoller(monitor_t)
        self.faults = FaultDriver(self.swarm, self.poller, _seeded(cfg.faults, cfg.seed))
        spec = model.spec
        self.hostile = Hostile(hostile_t, spec.model_id, spec.num_layers, spec.hidden_size, spec.vocab_size,
                               seed=cfg.seed + 1)
        self._mark("clients ready")
        return conversations

    async def close(self) -> None:
        if self.hostile is not None:
            await self.hostile.close()
        if self.poller is not None:
            await self.poller.close()
        for t in self._transports:
            await t.close()
        for c in self.clients:
            await c.close()
        if self.swarm is not None:
            await asyncio.to_thread(self.swarm.close)

    # ----------------------------------------------------------------------------- the run

    async def run(self) -> dict:
        """Setup, chaos, drain, final checks; the report."""
        cfg = self.cfg
        try:
            conversations = await self.setup()
            stop_chat, stop_chaos, stop_watch = asyncio.Event(), asyncio.Event(), asyncio.Event()
            watcher = self._task(self._watch(stop_watch))
            workers = [self._task(chat_worker(self.clients[i % len(self.clients)], conversations, self.tally,
                                              stop_chat, cfg.seed * 1000 + i, cfg.max_new_tokens,
                                              cfg.request_deadline_s)) for i in range(cfg.clients)]
            chaos = [self._task(self.faults.run(stop_chaos)), self._task(self._attack(stop_chaos))]
            self._mark("chaos started")
            await self._until_done()
            stop_chaos.set()
            await asyncio.gather(*chaos)
            await self.hostile.close()  # its idle connections too: the last samples show the peers at rest
            self._mark("chaos stopped (every member recovered)")
            stop_chat.set()
            await asyncio.gather(*workers)
            self._mark("chat requests drained")
            await self._final_poll()
            stop_watch.set()
            await watcher
            return self.report()
        finally:
            for task in self._tasks:  # after an error: nothing may outlive the swarm it drives
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.close()

    def _task(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.append(task)
        return task

    async def _until_done(self) -> None:
        cfg = self.cfg
        start = time.monotonic()
        while True:
            elapsed = time.monotonic() - start
            if elapsed >= cfg.max_chaos_s or (elapsed >= cfg.min_chaos_s and self.faults.total >= cfg.min_faults):
                self.chaos_s = elapsed
                return
            await asyncio.sleep(0.5)

    async def _attack(self, stop: asyncio.Event) -> None:
        rng = random.Random(self.cfg.seed + 2)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), rng.uniform(*self.cfg.attack_gap_s))
                return
            except TimeoutError:
                pass
            healthy = self.faults.healthy()
            targets = [(a[0], a[1], span) for slot, span in sorted(healthy.items())
                       if (a := self.swarm.peer_addr(slot)) is not None]
            await self.hostile.attack(targets)

    async def _watch(self, stop: asyncio.Event) -> None:
        """Poll every live peer's stats each ``stats_period_s``; sample RSS/fds each ``rss_period_s``."""
        last_rss = -1e9
        while not stop.is_set():
            await self._poll_all()
            if time.monotonic() - last_rss >= self.cfg.rss_period_s:
                self.sampler.sample()
                last_rss = time.monotonic()
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.stats_period_s)
            except TimeoutError:
                pass
        self.sampler.sample()

    async def _poll_all(self) -> None:
        polls = []
        for slot, child in list(self.swarm.slots.items()):
            addr = self.swarm.peer_addr(slot)
            if not child.alive:  # never sample a reaped pid: the number may belong to another process by now
                self.sampler.retire(child.name)
            elif self.poller.served(child.name, float("inf")) is not None:  # followed once it serves a
                self.sampler.track(child.name, child.proc.pid)  # range: the first sample is its loaded baseline
            if slot in self.swarm.down or slot in self.swarm.paused or addr is None:
                continue
            polls.append(self.poller.poll(child.name, *addr))
        await asyncio.gather(*polls)

    async def _final_poll(self, timeout_s: float = 120.0) -> None:
        """After the chaos: until every slot's current process (restarted ones included) has
        answered a stats poll made after this point."""
        since = time.monotonic()

        def answered(child) -> bool:
            got = self.poller.latest.get(child.name)
            return got is not None and got[0] >= since

        end = since + timeout_s
        while time.monotonic() < end and not all(answered(c) for c in self.swarm.slots.values()):
            await self._poll_all()
            await asyncio.sleep(1.0)
        self.unanswered_at_end = [c.name for c in self.swarm.slots.values() if not answered(c)]
        self._mark("final stats polled")

    # ----------------------------------------------------------------------------- report

    def report(self) -> dict:
        cfg, faults = self.cfg, self.faults
        return {
            "config": {"clients": cfg.clients, "client_nodes": cfg.client_nodes, "peers": cfg.spec.peers,
                       "coordinators": cfg.spec.coordinators, "num_layers": cfg.spec.num_layers,
                       "max_layers_per_peer": cfg.spec.max_layers, "max_new_tokens": cfg.max_new_tokens,
                       "seed": cfg.seed, "max_down": cfg.faults.max_down,
                       "client": {k: getattr(cfg.client_config, k) for k in
                                  ("hop_timeout_s", "connect_timeout_s", "max_retries", "ban_base_s", "ban_max_s",
                                   "no_route_wait_s")},
                       "application_level_retries": 0},
            "timeline_s": self.timeline,
            "chaos_s": round(getattr(self, "chaos_s", 0.0), 1),
            "requests": self.tally.summary(),
            "faults": {"total": faults.total, "by_kind": dict(faults.injected), "skipped": dict(faults.skipped),
                       "events": faults.events, "skip_log": faults.skip_log},
            "attacks": self.hostile.summary(),
            "compute": {"dead_threads": len(self.poller.dead_compute), "details": self.poller.dead_compute,
                        "stats_polls": self.poller.polls, "unanswered_polls": self.poller.unanswered,
                        "processes_polled": len(self.poller.latest),
                        "not_answering_at_end": getattr(self, "unanswered_at_end", [])},
            "peer_processes": self.sampler.summary(),
            "peer_descriptors_at_end": {c.name: {"fds": fd_kinds(c.proc.pid), "sockets": sockets(c.proc.pid)}
                                        for c in self.swarm.slots.values() if c.alive},
            "restarts": dict(self.swarm.restarts),
            "logs": str(self.swarm.children.logdir),
        }


def _seeded(faults: FaultConfig, seed: int) -> FaultConfig:
    from dataclasses import replace

    return replace(faults, seed=seed)


async def _first_reply(client: AsyncClient, conversation, timeout_s: float = 120.0) -> None:
    """Setup only: retry one chat until the client's view of the swarm yields a route."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            await client.chat(list(conversation.messages), max_new_tokens=4, ignore_eos=True)
            return
        except Exception:
            if time.monotonic() > end:
                raise
            await asyncio.sleep(1.0)


async def run_chaos(cfg: ChaosConfig) -> dict:
    """Run one chaos run (see the module docstring) and return its report."""
    return await Chaos(cfg).run()
