"""Recent durations of one kind of work, for the medians a peer reports in ``PeerStats``."""

from __future__ import annotations

import statistics
from collections import deque

WINDOW = 64  # samples behind each median: recent enough to follow load, enough to be stable


class RecentTimes:
    """The last ``window`` durations (seconds) of something; one writer, any reader."""

    def __init__(self, window: int = WINDOW):
        self._samples: deque[float] = deque(maxlen=window)

    def add(self, seconds: float) -> None:
        """Record one duration (the oldest drops out of the window)."""
        self._samples.append(seconds)

    @property
    def median_ms(self) -> float:
        """Median of the window in ms (0 before the first sample)."""
        samples = list(self._samples)  # a copy: the writer may be another thread
        return 1000 * statistics.median(samples) if samples else 0.0
