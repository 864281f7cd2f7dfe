"""Watching peer processes from outside: memory and descriptors (psutil), and the peers' own
``GetStats`` answers (served range, sessions, KV, and whether the compute thread lives).

Both the chaos driver and the soak benchmark use it. A peer *process* is one incarnation of a
slot; figures are kept per process name (``peer0``, ``peer0.1`` after a restart) because a new
process starts from a new baseline.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Optional

import psutil

from p2pserve.client.connection import HopConnection
from p2pserve.client.hop import Hop
from p2pserve.config import ClientConfig
from p2pserve.protocol import PeerStats


def process_figures(pid: int) -> Optional[dict]:
    """RSS and open fds of process ``pid`` alone (``main``) and with its descendants (``total``:
    the peer's DHT child and its go-libp2p daemon), or None if it is gone."""
    try:
        root = psutil.Process(pid)
        if root.status() == psutil.STATUS_ZOMBIE:  # killed, not reaped yet: it reads as 0 bytes
            return None
        procs = [root] + root.children(recursive=True)
        out = {"rss_main": root.memory_info().rss, "fds_main": root.num_fds(), "rss_total": 0, "fds_total": 0,
               "processes": len(procs)}
        for p in procs:
            try:
                out["rss_total"] += p.memory_info().rss
                out["fds_total"] += p.num_fds()
            except psutil.NoSuchProcess:  # a child that exited between the listing and the read
                pass
        return out
    except psutil.NoSuchProcess:
        return None


def sockets(pid: int) -> dict[str, int]:
    """Sockets of ``pid`` by family and state ("tcp:ESTABLISHED", "unix:NONE"...)."""
    import collections

    kinds: collections.Counter = collections.Counter()
    try:
        for c in psutil.Process(pid).net_connections(kind="all"):
            kinds[f"{'unix' if c.family.name == 'AF_UNIX' else 'tcp'}:{c.status}"] += 1
    except psutil.Error:
        return {}
    return dict(kinds)


def fd_kinds(pid: int) -> dict[str, int]:
    """Open descriptors of ``pid`` by kind ("socket", "pipe", "anon_inode:[eventpoll]", a file's
    directory...), to tell which kind a leak is of. Empty if the process is gone."""
    import collections
    import os

    kinds: collections.Counter = collections.Counter()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            kind = target.split(":")[0] if target.startswith(("socket:", "pipe:")) else target
            kinds[kind if not kind.startswith("/") else os.path.dirname(kind)] += 1
    except OSError:
        return {}
    return dict(kinds)


@dataclass
class ProcessSeries:
    """Samples of one process over time: ``(t, rss_main, rss_total, fds_main, fds_total)``."""

    name: str
    pid: int
    samples: list[tuple] = field(default_factory=list)

    def add(self, t: float) -> None:
        f = process_figures(self.pid)
        if f is not None:
            self.samples.append((round(t, 1), f["rss_main"], f["rss_total"], f["fds_main"], f["fds_total"]))

    def summary(self) -> dict:
        """First, max and last of each figure (MiB for memory)."""
        if not self.samples:
            return {"name": self.name, "pid": self.pid, "samples": 0}
        cols = list(zip(*self.samples))
        mib = 1 / 2**20
        return {
            "name": self.name, "pid": self.pid, "samples": len(self.samples),
            # (t, RSS MiB, fds) of the process alone, then with its DHT child and daemon
            "series": [(t, round(a * mib, 1), c, round(b * mib, 1), d) for t, a, b, c, d in self.samples],
            "seconds": [cols[0][0], cols[0][-1]],
            "rss_main_mib": {"first": cols[1][0] * mib, "max": max(cols[1]) * mib, "last": cols[1][-1] * mib},
            "rss_total_mib": {"first": cols[2][0] * mib, "max": max(cols[2]) * mib, "last": cols[2][-1] * mib},
            "fds_main": {"first": cols[3][0], "max": max(cols[3]), "last": cols[3][-1]},
            "fds_total": {"first": cols[4][0], "max": max(cols[4]), "last": cols[4][-1]},
        }


class ProcessSampler:
    """RSS/fd series of every process it is told about (by name), sampled together."""

    def __init__(self):
        self.t0 = time.monotonic()
        self.series: dict[str, ProcessSeries] = {}
        self.retired: set[str] = set()

    def track(self, name: str, pid: int) -> None:
        """Start following ``name`` (no-op if already followed)."""
        if name not in self.series:
            self.series[name] = ProcessSeries(name, pid)

    def retire(self, name: str) -> None:
        """Stop sampling ``name`` (it exited); its samples stay."""
        self.retired.add(name)

    def sample(self) -> None:
        """One sample of every followed process that still runs."""
        t = time.monotonic() - self.t0
        for name, s in self.series.items():
            if name not in self.retired:
                s.add(t)

    def summary(self) -> dict:
        return {name: s.summary() for name, s in self.series.items()}


class StatsPoller:
    """Keeps one stream per peer process and asks it ``GetStats``; remembers the latest answer.

    A peer whose compute thread died (``compute_alive`` false) or was restarted
    (``compute_restarts`` > 0) is recorded in ``dead_compute`` under its process name.
    """

    def __init__(self, transport, timeout_s: float = 3.0):
        self.transport = transport
        self.timeout_s = timeout_s
        self.conns: dict[str, HopConnection] = {}
        self.latest: dict[str, tuple[float, PeerStats]] = {}  # name -> (monotonic time, stats)
        self.dead_compute: dict[str, dict] = {}
        self.polls = 0
        self.unanswered = 0

    async def poll(self, name: str, peer_id: str, maddrs: tuple[str, ...]) -> Optional[PeerStats]:
        """Ask process ``name`` (peer ``peer_id``) for its stats; None if it did not answer in time."""
        conn = self.conns.get(name)
        if conn is None or conn.hop.peer_id != peer_id:
            conn = self.conns[name] = HopConnection(self.transport, Hop(peer_id, 0, 0, maddrs),
                                                    ClientConfig().frame_limits, self.timeout_s, self.timeout_s)
        self.polls += 1
        try:
            async with asyncio.timeout(self.timeout_s * 2):
                stats = await conn.stats()
        except Exception:  # dead, frozen or restarting: drop the stream, dial afresh next time
            self.unanswered += 1
            await self.forget(name)
            return None
        self.latest[name] = (time.monotonic(), stats)
        if not stats.compute_alive or stats.compute_restarts > 0:
            self.dead_compute[name] = {"compute_alive": stats.compute_alive, "compute_restarts": stats.compute_restarts,
                                       "stuck_s": stats.stuck_s}
        return stats

    async def forget(self, name: str) -> None:
        """Close the stream to ``name`` (it died, or will not be polled again)."""
        conn = self.conns.pop(name, None)
        if conn is not None:
            conn.stream, stream = None, conn.stream
            if stream is not None:
                stream.close()

    def served(self, name: str, max_age_s: float) -> Optional[tuple[int, int]]:
        """The range ``name`` said it serves in an answer at most ``max_age_s`` old (None: none
        that recent, or it serves nothing)."""
        got = self.latest.get(name)
        if got is None or time.monotonic() - got[0] > max_age_s:
            return None
        st = got[1]
        return (st.served_start, st.served_end) if st.served_end > st.served_start else None

    async def close(self) -> None:
        for name in list(self.conns):
            await self.forget(name)
