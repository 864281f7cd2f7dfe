"""Launching `python -m p2pserve.cli ...` child processes: for `p2pserve demo`, the integration
tests and the benchmarks (the one place that starts and stops them).

Each child runs in its own process group, so that stopping it takes its DHT child process and
libp2p daemon along, and single-threaded by default (the test machine has two shared cores).
Output goes to a log file or, without one, into ``Child.lines``. ``PeerProcess.wait_ready``
waits for a peer's ready line (``Child.ready`` reads it from any peer child, log file or not);
:class:`Children` stops a whole set together. ``Child.pause``/``resume`` freeze the process
itself (not its DHT child or daemon): a hung peer, for the chaos tests. Every child stops its
whole group once this process is gone (``p2pserve/parent_watch.py``), so a killed test run or
benchmark leaves no orphans behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

from p2pserve.client.hop import Hop
from p2pserve.parent_watch import PARENT_ENV
from p2pserve.types import PeerId


@dataclass
class Child:
    """One `python -m p2pserve.cli ARGS` process in its own process group."""

    name: str
    proc: subprocess.Popen
    log_path: Optional[Path] = None
    lines: list[str] = field(default_factory=list)

    @classmethod
    def spawn(cls, name: str, args: list[str], *, threads: int = 1, log_path: Optional[Path] = None,
              env: Optional[Mapping[str, str]] = None) -> "Child":
        """Start the process (do not wait for it); output to ``log_path``, else into ``lines``.

        ``env`` adds to (or overrides) this process's environment, e.g. a ``PYTHONPATH`` that
        makes the child import the same source tree as its parent.
        """
        cmd = [sys.executable, "-m", "p2pserve.cli", *args]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
                   **{PARENT_ENV: str(os.getpid())}, **(env or {}))  # it stops when we are gone
        if log_path is not None:
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            return cls(name, proc, log_path)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        child = cls(name, proc)
        threading.Thread(target=child._pump, daemon=True).start()
        return child

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self, tail_chars: int = 4000) -> str:
        """The end of what the process printed."""
        if self.log_path is not None:
            return self.log_path.read_text(errors="replace")[-tail_chars:]
        return "\n".join(self.lines)[-tail_chars:]

    @property
    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc.poll() is None

    def ready(self) -> Optional[dict[str, str]]:
        """The fields of the peer's ready line once it printed one (a restart prints a new one), else None."""
        text = self.log_path.read_text(errors="replace") if self.log_path is not None else "\n".join(self.lines)
        return parse_ready(text.splitlines())

    def pause(self) -> None:
        """SIGSTOP the process itself: it hangs while its DHT child and libp2p daemon run on, so
        its streams accept frames that nobody answers (a hung peer, not a vanished one)."""
        if self.alive:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT what :meth:`pause` stopped."""
        if self.alive:
            os.kill(self.proc.pid, signal.SIGCONT)

    def check(self) -> None:
        """Raise RuntimeError, with the end of its output, if the process exited."""
        if not self.alive:
            raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}:\n{self.output(2000)}")

    def terminate(self) -> None:
        """SIGTERM the process group (do not wait)."""
        if self.alive:
            _signal_group(self.proc.pid, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the whole process group (the process and its DHT / libp2p daemon children)."""
        _signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL the group if anything lingers after ``timeout``."""
        self.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        self.kill()


def parse_ready(lines) -> Optional[dict[str, str]]:
    """The ``key=value`` fields of the last ``P2PSERVE_PEER_READY`` line in ``lines``, or None."""
    for line in reversed(list(lines)):
        if line.startswith("P2PSERVE_PEER_READY"):
            return dict(part.split("=", 1) for part in line.split()[1:])
    return None


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:  # the whole group is gone already
        pass


class Children:
    """Named children logging into ``logdir``, all stopped together by :meth:`stop_all`."""

    def __init__(self, logdir: Path, env: Optional[Mapping[str, str]] = None):
        self.logdir = Path(logdir)
        self.env = dict(env or {})  # added to every child's environment
        self.procs: dict[str, Child] = {}

    def start(self, name: str, *args: str, threads: int = 1) -> Child:
        """Start `p2pserve ARGS` as ``name`` (log: ``logdir/NAME.log``); a name started again
        replaces the entry (stop the old child first)."""
        child = Child.spawn(name, list(args), threads=threads, log_path=self.logdir / f"{name}.log", env=self.env)
        self.procs[name] = child
        return child

    def check(self) -> None:
        """Raise if a child died, showing the end of its log."""
        for child in self.procs.values():
            child.check()

    def stop_all(self, timeout: float = 10.0) -> None:
        """SIGTERM every child, give them ``timeout`` together, then SIGKILL every group."""
        for child in self.procs.values():
            child.terminate()
        deadline = time.monotonic() + timeout
        for child in self.procs.values():
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            child.kill()


@dataclass
class PeerProcess(Child):
    """A running `p2pserve peer` process, with what its ready line announced."""

    peer_id: PeerId = ""
    maddrs: tuple[str, ...] = ()
    layers: tuple[int, int] = (0, 0)

    @classmethod
    def launch(cls, model: str, layers: tuple[int, int] | None, *extra: str, threads: int = 1) -> "PeerProcess":
        """Start a peer process on loopback (do not wait for it)."""
        args = ["peer", "--model", model, "--num-threads", str(threads), "--log-level", "WARNING",
                "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
        if layers is not None:
            args += ["--layers", f"{layers[0]}:{layers[1]}"]
        return cls.spawn("peer", args + list(extra), threads=threads)

    def wait_ready(self, timeout: float = 120.0) -> "PeerProcess":
        """Block until the ready line appears; raise with the peer's output if it dies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fields = parse_ready(list(self.lines))
            if fields is not None:
                self.peer_id = fields["peer_id"]
                self.maddrs = tuple(fields["maddrs"].split(","))
                if fields["layers"] != "none":
                    a, b = fields["layers"].split(":")
                    self.layers = (int(a), int(b))
                return self
            if not self.alive:
                raise RuntimeError("peer exited early:\n" + "\n".join(self.lines[-40:]))
            time.sleep(0.05)
        raise TimeoutError("peer did not become ready:\n" + "\n".join(self.lines[-40:]))

    def hop(self, start: int | None = None, end: int | None = None) -> Hop:
        """A Hop running [start, end) on this peer (default: its whole range)."""
        return Hop(self.peer_id, self.layers[0] if start is None else start,
                   self.layers[1] if end is None else end, self.maddrs)


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
