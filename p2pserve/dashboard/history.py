"""Tokens/s over time: a rolling window of samples taken at every dashboard refresh (pure).

Three sources, each what its process can honestly know:

* ``max_flow`` — the followed plan's max-flow (tokens/s the coordinator plans the swarm to
  carry), in every process;
* ``observed`` — per peer, the median one-session decode rate clients report in the DHT
  (``ServiceReports.rates[].rate``; one session's tokens/s with the link RTT taken out), in every
  process; only the ``max_peers`` fastest peers of each sample are kept;
* ``served`` — tokens this process's own requests generated since the previous sample, divided
  by the time between the samples (``p2pserve api --dashboard`` only; None elsewhere).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Sample:
    """One refresh's figures (tokens/s; None where the source had nothing)."""

    t: float
    max_flow: Optional[float]
    served: Optional[float]
    observed: dict[str, float]


class History:
    """The last ``max_samples`` samples; ``as_json`` aligns them into series for a chart."""

    def __init__(self, max_samples: int = 300, max_peers: int = 16):
        self.samples: deque[Sample] = deque(maxlen=max_samples)
        self.max_peers = max_peers
        self._last_tokens: Optional[tuple[float, int]] = None  # (t, tokens_total) at the last sample

    def served_rate(self, t: float, tokens_total: Optional[int]) -> Optional[float]:
        """Tokens/s generated since the previous call (None on the first call or without a log)."""
        if tokens_total is None:
            return None
        last, self._last_tokens = self._last_tokens, (t, tokens_total)
        if last is None or t <= last[0]:
            return None
        return max(0, tokens_total - last[1]) / (t - last[0])

    def add(self, t: float, max_flow: Optional[float], served: Optional[float], observed: dict[str, float]) -> None:
        """Keep one sample (only the ``max_peers`` highest observed rates)."""
        top = sorted(observed.items(), key=lambda kv: (-kv[1], kv[0]))[: self.max_peers]
        self.samples.append(Sample(t, max_flow, served, dict(top)))

    def as_json(self) -> dict[str, Any]:
        """``{"t": [...], "max_flow": [...], "served": [...], "observed": {peer_id: [...]}}``,
        every list aligned with ``t`` (None where a sample had no value); at most ``max_peers``
        peers, those with the highest rate in any sample."""
        best: dict[str, float] = {}
        for s in self.samples:
            for pid, rate in s.observed.items():
                best[pid] = max(rate, best.get(pid, 0.0))
        peers = sorted(best, key=lambda p: (-best[p], p))[: self.max_peers]
        return {
            "t": [s.t for s in self.samples],
            "max_flow": [s.max_flow for s in self.samples],
            "served": [s.served for s in self.samples],
            "observed": {p: [s.observed.get(p) for s in self.samples] for p in sorted(peers)},
        }
