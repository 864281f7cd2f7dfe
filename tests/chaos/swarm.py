"""A whole swarm of real processes on loopback, for the chaos test and the soak and chaos benchmarks.

A bootstrap node, trusted coordinators (priorities N..1, so ``coord-1`` leads while it lives) and
plan-driven peers (``--max-layers`` below the model's depth, so the plan must spread the model
over several peers), all ``python -m p2pserve.cli`` children from :mod:`p2pserve.launch`, each in
its own process group. Peers are *slots* (``peer0``...): a killed slot restarts as a new process
(``peer0.1``, a new peer id) in the same slot, so figures can be kept per slot and per process.

Refresh periods are short (records live 2 s) so that a dead member leaves the plan within
seconds. Every child gets ``PYTHONPATH`` = this source tree first, so children import the code
under test even where an editable install points elsewhere.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from p2pserve.launch import Child, Children

REPO = Path(__file__).resolve().parents[2]
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
TIMING = dict(peer_refresh=0.5, candidate_refresh=0.5, plan_refresh=2.0, link_refresh=10.0, max_clock_skew=2.0)


@dataclass
class SwarmSpec:
    """Shape of the swarm: how many members, what each peer may hold, extra peer flags."""

    num_layers: int = 12
    peers: int = 5
    max_layers: int = 8  # of 12: the plan chains peers, and most layers get three replicas
    coordinators: int = 2
    swarm_id: str = "chaos"
    timing: dict = field(default_factory=lambda: dict(TIMING))
    peer_args: tuple[str, ...] = ()  # e.g. ("--kv-token-layers", "40000", "--session-idle-timeout", "5")
    log_level: str = "INFO"


def build_model(workdir: Path, num_layers: int, seed: int = 0) -> str:
    """The seeded tiny fp32 Llama with ``num_layers`` layers under ``workdir`` (built offline once)."""
    from p2pserve.model.tiny import build_tiny_model

    return str(build_tiny_model("llama", Path(workdir) / f"llama-{num_layers}", seed=seed, num_layers=num_layers))


def covered(spans, num_layers: int) -> bool:
    """Whether the half-open ``spans`` hold every layer of [0, num_layers)."""
    return all(any(a <= layer < b for a, b in spans) for layer in range(num_layers))


class LocalSwarm:
    """Starts, faults and stops the members of one swarm; ``observer`` reads its DHT records."""

    def __init__(self, logdir: Path, model_path: str, spec: SwarmSpec = SwarmSpec()):
        import os

        from p2pserve.client.model_info import LocalModelInfo

        self.spec = spec
        self.model_path = model_path
        self.model = LocalModelInfo.load(model_path)
        pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        self.children = Children(Path(logdir), env={"PYTHONPATH": pythonpath})
        self.slots: dict[str, Child] = {}  # peer slot -> its current process
        self.coords: dict[str, Child] = {}  # coordinator id -> its current process
        self.restarts: dict[str, int] = {}  # member name -> processes started after the first
        self.paused: set[str] = set()
        self.down: set[str] = set()  # members killed and not restarted yet
        self.boot: list[str] = []
        self.cfg_path = self.children.logdir / "swarm.json"
        self.observer = None

    # ----------------------------------------------------------------------------- start / stop

    def start(self, ready_timeout: float = 300.0) -> None:
        """Start everything and wait until every peer printed its ready line."""
        from p2pserve.cli.common import write_local_swarm_file
        from p2pserve.dht.signing import load_or_create_key, public_key_text
        from p2pserve.peer.profiler import load_or_measure

        # Profile once here: peers find it in the shared cache instead of all timing forwards at once.
        load_or_measure(self.model_path, self.model.spec, "cpu", self.spec.max_layers)
        maddrs_file = self.children.logdir / "boot.maddrs"
        self.children.start("boot", "bootstrap", "--host-maddrs", LOOPBACK, "--maddrs-file", str(maddrs_file),
                            "--log-level", "WARNING")
        self._wait(maddrs_file.exists, "the bootstrap node", ready_timeout)
        self.boot = maddrs_file.read_text().split()
        keys = {f"coord-{i + 1}": str(self.children.logdir / f"coord-{i + 1}.key") for i in range(self.spec.coordinators)}
        self.trusted = tuple(public_key_text(load_or_create_key(k)) for k in keys.values())
        self.keys = keys
        write_local_swarm_file(self.cfg_path, self.model.spec, self.boot, self.spec.swarm_id, LOOPBACK, self.spec.timing,
                               0.5, trusted_coordinators=self.trusted)
        for name in keys:
            self.start_coordinator(name)
        for i in range(self.spec.peers):
            self.start_peer(f"peer{i}")
        self._wait(lambda: all(c.ready() for c in self.slots.values()), "every peer's ready line", ready_timeout)
        from p2pserve.dht.swarm import Swarm

        self.observer = Swarm.create(self.dht_config())

    def dht_config(self):
        """A client-mode DHTConfig of this swarm (for clients and the observer)."""
        from p2pserve.config import DHTConfig

        return DHTConfig(model=self.model.spec.model_id, swarm_id=self.spec.swarm_id, initial_peers=tuple(self.boot),
                         host_maddrs=(LOOPBACK,), client_mode=True, trusted_coordinators=self.trusted,
                         **self.spec.timing)

    def _name(self, member: str) -> str:
        n = self.restarts.get(member)
        return member if n is None else f"{member}.{n}"

    def start_coordinator(self, coord_id: str) -> Child:
        """Start (or restart) coordinator ``coord_id`` with its key; priority: coord-1 highest."""
        priority = self.spec.coordinators - int(coord_id.split("-")[1]) + 1
        child = self.children.start(self._name(coord_id), "coordinator", "--config", str(self.cfg_path), "--key-path",
                                    self.keys[coord_id], "--priority", str(priority), "--coordinator-id", coord_id,
                                    "--log-level", self.spec.log_level)  # its published epochs, for post-mortems
        self.coords[coord_id] = child
        return child

    def start_peer(self, slot: str) -> Child:
        """Start (or restart) the peer process of ``slot``: plan-driven, one torch thread."""
        child = self.children.start(self._name(slot), "peer", "--model", self.model_path, "--config", str(self.cfg_path),
                                    "--num-threads", "1", "--max-layers", str(self.spec.max_layers),
                                    "--probe-max-mb", "4", "--log-level", self.spec.log_level, *self.spec.peer_args)
        self.slots[slot] = child
        return child

    def restart(self, member: str) -> Child:
        """A new process for a killed peer slot or coordinator (its log gets a new name)."""
        self.restarts[member] = self.restarts.get(member, 0) + 1
        self.down.discard(member)
        return self.start_coordinator(member) if member in self.coords else self.start_peer(member)

    def kill(self, member: str) -> None:
        """SIGKILL a peer slot's or coordinator's whole process group (no goodbye, records expire)."""
        self.paused.discard(member)
        self.down.add(member)
        (self.coords.get(member) or self.slots[member]).kill()

    def check(self) -> None:
        """Raise, with the end of its log, if a member that should be running has exited."""
        members = {"boot": self.children.procs["boot"], **self.coords, **self.slots}
        for name, child in members.items():
            if name not in self.down:
                child.check()

    def pause(self, slot: str) -> None:
        """Freeze a peer process (SIGSTOP): a hung peer whose daemon still accepts streams."""
        self.slots[slot].pause()
        self.paused.add(slot)

    def resume(self, slot: str) -> None:
        """SIGCONT a frozen peer."""
        self.paused.discard(slot)
        self.slots[slot].resume()

    def close(self) -> None:
        """Stop everything (frozen peers are woken first so that SIGTERM can reach them)."""
        for slot in list(self.paused):
            self.resume(slot)
        if self.observer is not None:
            self.observer.shutdown()
            self.observer = None
        self.children.stop_all(timeout=5.0)

    def _wait(self, check, what: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.check()
            if check():
                return
            time.sleep(0.3)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what} (logs in {self.children.logdir})")

    # ----------------------------------------------------------------------------- reading the swarm

    def peer_addr(self, slot: str) -> Optional[tuple[str, tuple[str, ...]]]:
        """(peer id, maddrs) of a slot's current process once it printed its ready line."""
        fields = self.slots[slot].ready()
        return None if fields is None else (fields["peer_id"], tuple(fields["maddrs"].split(",")))

    def slot_of(self, peer_id: str) -> Optional[str]:
        """The slot whose current process is ``peer_id``."""
        for slot in self.slots:
            addr = self.peer_addr(slot)
            if addr is not None and addr[0] == peer_id:
                return slot
        return None

    async def view(self):
        """(plan or None, {peer id: PeerInfo}) as the observer reads them now."""
        signed = await self.observer.get_plan()
        peers = await self.observer.get_peers()
        return (signed.plan if signed else None), {pid: s.record for pid, s in peers.items()}

    async def wait_serving(self, timeout: float = 300.0) -> None:
        """Until a plan exists, every peer announces a served range and those ranges cover every layer."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.check()
            plan, peers = await self.view()
            ids = {a[0] for a in map(self.peer_addr, self.slots) if a}
            serving = {pid: info.serving for pid, info in peers.items() if pid in ids and info.serving}
            if plan is not None and plan.flows and len(serving) == len(self.slots) \
                    and covered(serving.values(), self.spec.num_layers):
                return
            await asyncio.sleep(0.5)
        raise TimeoutError(f"the swarm did not serve every layer within {timeout:.0f} s (logs in {self.children.logdir})")
