"""Discrete-event engine: a heap of timestamped callbacks.

The simulator's hot loop lives here, so it is deliberately bare: an event is a tuple
``(time, seq, fn, arg)`` and running it is ``fn(arg)``. ``seq`` is a global counter that breaks
ties so that events scheduled for the same instant run in the order they were scheduled (FIFO),
which keeps runs deterministic and never compares two callbacks.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable


class EventLoop:
    """A simulated clock plus a priority queue of pending callbacks."""

    __slots__ = ("now", "_heap", "_seq", "events_run")

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = 0
        self.events_run = 0

    def at(self, time: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``fn(arg)`` at simulated ``time`` (never earlier than now)."""
        if time < self.now:
            time = self.now
        self._seq += 1
        heapq.heappush(self._heap, (time, self._seq, fn, arg))

    def after(self, delay: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``fn(arg)`` ``delay`` seconds from now."""
        self.at(self.now + delay, fn, arg)

    def pending(self) -> int:
        """Number of events not yet run."""
        return len(self._heap)

    def run(self, until: float) -> None:
        """Run events in time order until the queue is empty or the next one is after ``until``.

        The clock ends at ``until`` (or at the last event when the queue drains earlier).
        """
        heap = self._heap
        pop = heapq.heappop
        n = 0
        while heap and heap[0][0] <= until:
            time, _, fn, arg = pop(heap)
            self.now = time
            fn(arg)
            n += 1
        self.events_run += n
        if until > self.now and until != float("inf"):
            self.now = until
