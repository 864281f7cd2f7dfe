"""A machine agent: offers a machine's slots to the swarm and runs the TP groups the plan asks for.

``p2pserve machine`` (``cli/machine.py``) measures the links between its slots
(``slot_links.py``) and one slot's decode profile, and announces them as a signed
``MachineInfo`` with the groups it runs now. The coordinator chooses the machine's grouping
(``coordinator/groupings.py``) and publishes it in ``Plan.groupings``; the agent runs one
plan-driven ``p2pserve peer`` child per group (``--tp d`` on CPU, ``--gpu a,b`` on CUDA), each of
which gets its layer range from the plan like any peer.

A regroup is make-before-break (the rule of layer moves, ``peer/handover.py``):

1. the new groups start (on CPU slots are processes and may overlap; on GPUs this needs the
   memory of both, see docs/machine-agent.md) and wait for the plan to give them a range;
2. once every new group serves, the old ones are *retired* (SIGUSR1: announced draining, still
   answering), so the coordinator plans without them;
3. an old group stops (SIGTERM) only when every layer it serves is served by a peer that is not
   draining.

The decisions are pure (:func:`slot_sets`, :func:`transition`, :func:`may_stop`); the class is
the thin shell over child processes and the swarm's records.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from p2pserve.config import MachineConfig
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.machine_info import GpuLink, GpuOffer, MachineGroup, MachineInfo
from p2pserve.dht.records import PeerInfo
from p2pserve.launch import Child
from p2pserve.types import PeerId

log = logging.getLogger(__name__)

Slots = tuple[int, ...]
STOP_GRACE_S = 30.0  # a stopping group's peer gets this long to withdraw and exit


def slot_sets(degrees: Sequence[int]) -> list[Slots]:
    """Groups of consecutive slots: [2, 1, 1] -> [(0, 1), (2,), (3,)]."""
    out, at = [], 0
    for d in degrees:
        out.append(tuple(range(at, at + d)))
        at += d
    return out


def transition(running: Sequence[Slots], wanted: Sequence[Slots]) -> tuple[list[Slots], list[Slots]]:
    """(groups to start, groups to retire) to go from ``running`` to ``wanted``."""
    return [g for g in wanted if g not in running], [g for g in running if g not in wanted]


def may_stop(peer_id: PeerId, peers: Mapping[str, PeerInfo]) -> bool:
    """Whether a retired group may stop: every layer it serves is served by a peer not draining
    (its own record missing from a read is a miss, not a sign that it serves nothing: wait)."""
    me = peers.get(peer_id)
    if me is None:
        return False
    if me.serving is None:
        return True
    served = set()
    for pid, p in peers.items():
        if pid != peer_id and p.state != "draining" and p.serving is not None:
            served |= set(range(*p.serving))
    return set(range(*me.serving)) <= served


@dataclass
class RunningGroup:
    """One TP group's child ``p2pserve peer`` process and what it announced."""

    slots: Slots
    child: Child
    peer_id: PeerId = ""
    retired: bool = False
    stopping_since: Optional[float] = None  # SIGTERM sent (monotonic); SIGKILL after STOP_GRACE_S


@dataclass
class MachineAgent:
    """The shell: child processes, MachineInfo announcements, the plan's grouping."""

    config: MachineConfig
    swarm: object  # a p2pserve.dht.swarm.Swarm (or the test double of p2pserve.testing.swarm)
    links: list[GpuLink]
    profile: list[float]
    groups: dict[Slots, RunningGroup] = field(default_factory=dict)

    def info(self) -> MachineInfo:
        """This machine's announcement."""
        gpus = [GpuOffer(device=d, memory_bytes=self.config.memory_bytes, throughput_decode=list(self.profile))
                for d in self.config.devices]
        running, used = [], set()
        for g in reversed(list(self.groups.values())):  # newest first: while a regroup overlaps, the new groups
            if g.peer_id and not g.retired and not used & set(g.slots):
                running.append(MachineGroup(slots=list(g.slots), peer_id=g.peer_id))
                used |= set(g.slots)
        return MachineInfo(model=self.swarm.config.model, machine_id=self.swarm.peer_id, gpus=gpus, links=self.links,
                           groups=running, tp_degrees=list(self.config.tp_degrees), timestamp=time.time())

    def _peer_cmd(self, slots: Slots) -> list[str]:
        d = len(slots)
        devices = [self.config.devices[s] for s in slots]
        where = ["--device", "cpu"] + (["--tp", str(d)] if d > 1 else []) if devices[0] == "cpu" else \
            ["--gpu", ",".join(x.split(":")[1] for x in devices)]
        return ["peer", *self.config.peer_args, *where, "--max-layers", str(d * self.config.slot_max_layers)]

    def start_group(self, slots: Slots) -> None:
        """Start the group's plan-driven ``p2pserve peer``."""
        name = "group-" + "-".join(map(str, slots))
        log_path = self.config.logdir / f"{name}.log" if self.config.logdir else None
        child = Child.spawn(name, self._peer_cmd(slots), log_path=log_path)
        self.groups[slots] = RunningGroup(slots, child)
        log.info("started TP-%d group on slots %s (pid %d)", len(slots), list(slots), child.proc.pid)

    async def wanted(self) -> Optional[list[Slots]]:
        """The grouping to run: the fixed one, else the plan's for this machine (None: none yet)."""
        if self.config.grouping is not None:
            return slot_sets(self.config.grouping)
        signed = await self.swarm.get_plan()
        degrees = signed.plan.groupings.get(self.swarm.peer_id) if signed is not None else None
        return slot_sets(degrees) if degrees and sum(degrees) <= len(self.config.devices) else None

    async def step(self) -> None:
        """One round: learn peer ids, follow the grouping, retire and stop old groups."""
        for g in self.groups.values():
            if not g.peer_id and (ready := g.child.ready()):
                g.peer_id = ready["peer_id"]
        wanted = await self.wanted()
        if wanted is None:
            return
        start, retire = transition([s for s, g in self.groups.items() if not g.retired], wanted)
        for slots in start:
            if slots in self.groups:  # retired earlier, wanted again: let it finish stopping first
                continue
            self.start_group(slots)
        peers = {pid: s.record for pid, s in (await self.swarm.get_peers()).items()}
        new_serving = all(self.groups[s].peer_id in peers and peers[self.groups[s].peer_id].serving is not None
                          and peers[self.groups[s].peer_id].state == "serving" for s in wanted if s in self.groups)
        for slots in retire:
            g = self.groups[slots]
            if new_serving and g.peer_id:
                log.info("retiring the group on slots %s (%s)", list(slots), g.peer_id[-8:])
                g.child.proc.send_signal(signal.SIGUSR1)
                g.retired = True
        self._stop_retired(peers)

    def _stop_retired(self, peers: Mapping[str, PeerInfo]) -> None:
        """SIGTERM retired groups whose layers are served elsewhere; forget them once exited (the
        agent's loop keeps announcing meanwhile: a peer may take seconds to withdraw)."""
        now = time.monotonic()
        for slots, g in list(self.groups.items()):
            if g.retired and g.stopping_since is None and may_stop(g.peer_id, peers):
                log.info("stopping the group on slots %s: its layers are served elsewhere", list(slots))
                g.child.terminate()
                g.stopping_since = now
            if g.stopping_since is not None and (not g.child.alive or now - g.stopping_since > STOP_GRACE_S):
                g.child.kill()  # the group's DHT / daemon children too
                del self.groups[slots]

    def stop_all(self, grace_s: float = 20.0) -> None:
        """SIGTERM every group at once (each withdraws and exits), SIGKILL what is left after ``grace_s``."""
        for g in self.groups.values():
            g.child.terminate()
        deadline = time.monotonic() + grace_s
        for g in self.groups.values():
            try:
                g.child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            g.child.kill()

    async def run(self, stop: asyncio.Event) -> None:
        """Announce and follow until ``stop``; then stop every group."""
        try:
            while not stop.is_set():
                try:
                    await self.step()
                    await self.swarm.announce(RecordKind.MACHINES, self.info())
                    for g in self.groups.values():
                        if not g.child.alive and not g.retired:
                            log.warning("the group on slots %s exited (%s)", list(g.slots), g.child.proc.returncode)
                except asyncio.CancelledError:
                    raise
                except Exception:  # a DHT hiccup must not stop the machine
                    log.exception("machine agent step failed; retrying")
                try:
                    await asyncio.wait_for(stop.wait(), self.config.refresh_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            await asyncio.to_thread(self.stop_all)
            try:
                await self.swarm.withdraw(RecordKind.MACHINES)
            except Exception:
                pass
