"""A directed network link that carries one message (a batch of jobs) at a time, FIFO.

Following the Helix simulator, a transfer occupies the link for ``latency + bytes / bandwidth``
and messages queue behind it in arrival order. ``bandwidth`` is in bytes/s under the convention
chosen by the caller (the Helix data's "1000 * mbps" read as 1e9 bytes/s reproduces the authors'
numbers; see ``docs/sim.md``).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from p2pserve.sim.engine import EventLoop


class Link:
    """FIFO, one-at-a-time transfer server between two vertices."""

    __slots__ = (
        "loop",
        "src",
        "dst",
        "bandwidth",
        "latency",
        "deliver",
        "_queue",
        "busy",
        "messages",
        "bytes_sent",
        "busy_time",
    )

    def __init__(
        self,
        loop: EventLoop,
        src: int,
        dst: int,
        bandwidth: float,
        latency: float,
        deliver: Callable[[list], None],
    ) -> None:
        self.loop = loop
        self.src = src
        self.dst = dst
        self.bandwidth = bandwidth  # bytes per second
        self.latency = latency  # seconds
        self.deliver = deliver  # called with the message's job list when it arrives
        self._queue: deque[tuple[list, float]] = deque()
        self.busy = False
        self.messages = 0
        self.bytes_sent = 0.0
        self.busy_time = 0.0

    def transfer_time(self, nbytes: float) -> float:
        """Seconds the link is occupied by one message of ``nbytes``."""
        return self.latency + nbytes / self.bandwidth

    def send(self, jobs: list, nbytes: float) -> None:
        """Queue a message; it starts as soon as every earlier message has been delivered."""
        if self.busy:
            self._queue.append((jobs, nbytes))
        else:
            self._start(jobs, nbytes)

    def queued(self) -> int:
        """Messages waiting behind the one in flight."""
        return len(self._queue)

    def _start(self, jobs: list, nbytes: float) -> None:
        self.busy = True
        dt = self.latency + nbytes / self.bandwidth
        self.messages += 1
        self.bytes_sent += nbytes
        self.busy_time += dt
        self.loop.after(dt, self._done, jobs)

    def _done(self, jobs: list) -> None:
        # Start the next transfer before delivering, so that a receiver reacting to this message
        # sees the link in its true state.
        if self._queue:
            nxt, nbytes = self._queue.popleft()
            self._start(nxt, nbytes)
        else:
            self.busy = False
        self.deliver(jobs)
