"""Launching real peer processes: used by `p2pserve demo`, the integration tests and benchmarks.

Each peer is `python -m p2pserve.cli peer ...` in its own process group, single-threaded
(the test machine has two shared cores). ``PeerProcess.start`` waits for the peer's ready line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from p2pserve.client.hop import Hop


@dataclass
class PeerProcess:
    """A running `p2pserve peer` process."""

    proc: subprocess.Popen
    peer_id: str = ""
    maddrs: tuple[str, ...] = ()
    layers: tuple[int, int] = (0, 0)
    lines: list[str] = field(default_factory=list)

    @classmethod
    def launch(cls, model: str, layers: tuple[int, int] | None, *extra: str, threads: int = 1) -> "PeerProcess":
        """Start a peer process (do not wait for it)."""
        cmd = [sys.executable, "-m", "p2pserve.cli", "peer", "--model", model, "--num-threads", str(threads),
               "--log-level", "WARNING", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
        if layers is not None:
            cmd += ["--layers", f"{layers[0]}:{layers[1]}"]
        cmd += list(extra)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        peer = cls(proc)
        threading.Thread(target=peer._pump, daemon=True).start()
        return peer

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_ready(self, timeout: float = 120.0) -> "PeerProcess":
        """Block until the ready line appears; raise with the peer's output if it dies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.startswith("P2PSERVE_PEER_READY"):
                    fields = dict(part.split("=", 1) for part in line.split()[1:])
                    self.peer_id = fields["peer_id"]
                    self.maddrs = tuple(fields["maddrs"].split(","))
                    if fields["layers"] != "none":
                        a, b = fields["layers"].split(":")
                        self.layers = (int(a), int(b))
                    return self
            if self.proc.poll() is not None:
                raise RuntimeError("peer exited early:\n" + "\n".join(self.lines[-40:]))
            time.sleep(0.05)
        raise TimeoutError("peer did not become ready:\n" + "\n".join(self.lines[-40:]))

    def hop(self, start: int | None = None, end: int | None = None) -> Hop:
        """A Hop running [start, end) on this peer (default: its whole range)."""
        return Hop(self.peer_id, self.layers[0] if start is None else start,
                   self.layers[1] if end is None else end, self.maddrs)

    def kill(self) -> None:
        """SIGKILL the whole process group (the peer and its DHT / libp2p daemon children)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL the group if it lingers."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.kill()


def start_peers(model: str, ranges: list[tuple[int, int] | None], *extra: str,
                ready_timeout: float = 120.0) -> list[PeerProcess]:
    """Launch peers in parallel and wait until all are ready (kills all on failure)."""
    peers = [PeerProcess.launch(model, r, *extra) for r in ranges]
    try:
        for p in peers:
            p.wait_ready(ready_timeout)
    except BaseException:
        for p in peers:
            p.kill()
        raise
    return peers
