"""Child processes of integration tests: start, crash, stop, restart, and wait for a condition."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]


def killpg(p: subprocess.Popen) -> None:
    """SIGKILL a child's whole process group (its DHT child and p2pd too) and reap it."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(10)


class Procs:
    """Child processes, each in its own session so that its whole tree can be killed by pgid."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.procs: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, list[str]] = {}  # to restart a member a test stopped

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "ab")
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        p = subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, env=env)
        log.close()
        self.procs[name], self.commands[name] = p, args
        return p

    def ensure(self, name: str) -> None:
        """Restart ``name`` (with its first command line) unless it is running."""
        if name not in self.procs:
            self.start(name, self.commands[name])

    def log(self, name: str) -> str:
        return (self.logdir / f"{name}.log").read_text(errors="replace")

    def kill(self, name: str) -> None:
        """Crash: SIGKILL the process and everything it started (DHT child, p2pd)."""
        killpg(self.procs.pop(name))

    def stop(self, name: str, grace: float = 15.0) -> None:
        """Graceful stop (SIGTERM, records withdrawn), then make sure the whole group is gone."""
        p = self.procs.pop(name)
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        killpg(p)

    def close(self) -> None:
        """Stop everything: SIGTERM all at once, short grace, then SIGKILL every group."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        end = time.monotonic() + 5.0
        for p in self.procs.values():
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for name in list(self.procs):
            killpg(self.procs.pop(name))
