"""Peers behind delay relays: a swarm whose every link has a real one-way delay (tests, benchmarks).

Each peer gets its own relay process (:mod:`p2pserve.testing.delay_relay`) fronting its two
ports, its libp2p port and its direct TLS port, and announces the relay's addresses
(``--announce-maddrs``, ``--direct-announce-port``). Whoever dials the peer, a client or
another peer, then crosses that relay, so every link of the swarm carries exactly one relay's
delay each way (a libp2p connection is shared by both directions, whichever side dialled).
The relay's byte counts show that the traffic did cross it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from p2pserve.launch import PeerProcess
from p2pserve.testing import delay_relay

_PACKAGE_ROOT = str(Path(delay_relay.__file__).resolve().parents[2])  # the tree this code runs from


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now on ``host`` (the OS's pick; someone may take it before it is bound)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class RelayProcess:
    """A running relay process and the addresses it listens on (in the order of its routes)."""

    proc: subprocess.Popen
    listening: list[str]
    stats_path: Path

    @classmethod
    def start(cls, targets: list[str], stats_path: Path, *, delay_ms: float, rate_mbps: float = 0.0,
              host: str = "127.0.0.1", timeout: float = 60.0) -> "RelayProcess":
        """Relay a fresh port on ``host`` to each of ``targets`` (``HOST:PORT``); wait until it listens."""
        args = []
        for target in targets:
            args += ["--listen", f"{host}:0", "--to", target]
        # Run as a file, not with -m: the relay needs none of p2pserve.testing's imports, and
        # starts in a fraction of the time on a loaded machine (-P: its folder's modules, such
        # as testing/openai.py, must not shadow top-level ones).
        env = dict(os.environ, PYTHONPATH=_PACKAGE_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.Popen([sys.executable, "-P", delay_relay.__file__, *args, "--delay-ms", str(delay_ms),
                                 "--rate-mbps", str(rate_mbps), "--stats", str(stats_path)],
                                stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        line = _read_ready(proc, timeout)
        return cls(proc, line.split("=", 1)[1].split(","), stats_path)

    def stats(self) -> dict:
        """The relay's last written counts (``delay_relay`` rewrites them twice a second)."""
        try:
            return json.loads(self.stats_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {"routes": []}

    def stop(self) -> None:
        """SIGTERM the relay (it writes its final counts) and reap it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _read_ready(proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("P2PSERVE_RELAY_READY"):
            return line.strip()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"the relay exited with code {proc.returncode}")
    proc.kill()
    raise TimeoutError("the relay did not start")


@dataclass
class RelayedPeer:
    """A peer process and the relay in front of it."""

    peer: PeerProcess
    relay: RelayProcess

    def bytes_relayed(self, route: int = 0) -> tuple[int, int]:
        """Bytes the relay carried (to the peer, from the peer) on ``route``: 0 libp2p, 1 direct."""
        routes = self.relay.stats()["routes"]
        if len(routes) <= route:
            return 0, 0
        return routes[route]["bytes_to_target"], routes[route]["bytes_from_target"]

    def stop(self) -> None:
        """Stop the peer, then its relay."""
        self.peer.stop()
        self.relay.stop()


def stop_relayed_peers(peers: list[RelayedPeer], timeout: float = 10.0) -> None:
    """Stop peers together (SIGTERM to all, ``timeout`` for all, then SIGKILL), then their relays."""
    for rp in peers:
        rp.peer.terminate()
    deadline = time.monotonic() + timeout
    for rp in peers:
        try:
            rp.peer.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        rp.peer.kill()
    for rp in peers:
        rp.relay.stop()


def launch_relayed_peer(model: str, layers: Optional[tuple[int, int]], *extra: str, delay_ms: float,
                        rate_mbps: float = 0.0, workdir: Path) -> RelayedPeer:
    """Start a relay, then a peer on loopback that announces the relay's addresses (the peer is
    not waited for: ``.peer.wait_ready()``)."""
    lib_port, direct_port = free_port(), free_port()
    stats = Path(workdir) / f"relay-{lib_port}.json"
    relay = RelayProcess.start([f"127.0.0.1:{lib_port}", f"127.0.0.1:{direct_port}"], stats, delay_ms=delay_ms,
                               rate_mbps=rate_mbps)
    relay_lib, relay_direct = (delay_relay.parse_hostport(a)[1] for a in relay.listening)
    behind = ["--host-maddrs", f"/ip4/127.0.0.1/tcp/{lib_port}", "--announce-maddrs", f"/ip4/127.0.0.1/tcp/{relay_lib}",
              "--direct-port", str(direct_port), "--direct-announce-port", str(relay_direct)]
    try:
        peer = PeerProcess.launch(model, layers, *behind, *extra)
    except BaseException:
        relay.stop()
        raise
    return RelayedPeer(peer, relay)


def start_relayed_peers(model: str, ranges: list[Optional[tuple[int, int]]], *extra: str, delay_ms: float,
                        rate_mbps: float = 0.0, workdir: Path, ready_timeout: float = 180.0) -> list[RelayedPeer]:
    """Launch relayed peers in parallel and wait until all are ready (stops all on failure)."""
    started: list[RelayedPeer] = []
    try:
        for r in ranges:
            started.append(launch_relayed_peer(model, r, *extra, delay_ms=delay_ms, rate_mbps=rate_mbps,
                                               workdir=workdir))
        for rp in started:
            rp.peer.wait_ready(ready_timeout)
    except BaseException:
        for rp in started:
            rp.peer.kill()
            rp.relay.stop()
        raise
    return started


#: Peer flags for a relayed swarm whose records settle in seconds; links are probed once at start
#: (a probe's megabytes through the relays would otherwise compete with what is measured).
SWARM_TIMING = ("--peer-refresh", "0.5", "--link-refresh", "600", "--max-clock-skew", "2", "--probe-max-mb", "1")


def start_bootstrap(workdir: Path, timeout: float = 60.0):
    """A bootstrap DHT node on loopback for relayed peers to meet at (``--initial-peers``):
    returns its ``Children`` (``stop_all()`` when done) and its multiaddrs."""
    from p2pserve.launch import Children

    children = Children(Path(workdir))
    maddrs_file = Path(workdir) / "boot.maddrs"
    maddrs_file.unlink(missing_ok=True)  # a previous bootstrap's, in the same folder, is stale
    children.start("boot", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--maddrs-file", str(maddrs_file))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if maddrs_file.exists() and maddrs_file.read_text().split():
            return children, maddrs_file.read_text().split()
        time.sleep(0.2)
    children.stop_all()
    raise TimeoutError("the bootstrap node did not start")


def wait_announced(model_path: str, boot: list[str], peer_ids: list[str], num_layers: int,
                   timeout: float = 180.0) -> None:
    """Block until every one of ``peer_ids`` has a PeerInfo record readable from the swarm at
    ``boot`` (each peer then finds the others' announced addresses: push mode's next hops)."""
    import asyncio

    from p2pserve.config import DHTConfig
    from p2pserve.dht.swarm import Swarm
    from p2pserve.model.identity import derived_name

    observer = Swarm.create(DHTConfig(model=derived_name(model_path), initial_peers=tuple(boot), client_mode=True,
                                      host_maddrs=("/ip4/127.0.0.1/tcp/0",), num_layers=num_layers))
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if set(peer_ids) <= set(asyncio.run(observer.get_peers())):
                return
            time.sleep(0.5)
        raise TimeoutError(f"not every peer announced itself within {timeout:.0f} s")
    finally:
        observer.shutdown()


@contextmanager
def announced_swarm(model_path: str, ranges: list[Optional[tuple[int, int]]], *extra: str, delay_ms: float,
                    workdir: Path, num_layers: int, stop_timeout: float = 10.0) -> Iterator[tuple[list[str], list]]:
    """A bootstrap node and relayed peers on ``ranges`` that joined it (``SWARM_TIMING``, then
    ``extra`` flags) and announced themselves, so that each finds the others (push and ring next
    hops): yields (bootstrap multiaddrs, the relayed peers); stops them all on exit."""
    children, boot = start_bootstrap(workdir)
    relayed: list[RelayedPeer] = []
    try:
        relayed = start_relayed_peers(model_path, ranges, "--initial-peers", *boot, *SWARM_TIMING, *extra,
                                      delay_ms=delay_ms, workdir=workdir)
        wait_announced(model_path, boot, [rp.peer.peer_id for rp in relayed], num_layers=num_layers)
        yield boot, relayed
    finally:
        stop_relayed_peers(relayed, timeout=stop_timeout)
        children.stop_all()
