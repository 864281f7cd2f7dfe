"""Workloads: query lengths from a trace, online arrivals, and the offline feeding rule.

* Lengths: (input, output) pairs from the Azure conversation trace (the paper's filtered
  16,657 pairs), drawn with a seeded RNG.
* Online: the Azure arrival counts per 3 s bucket, rescaled so that the mean offered load is a
  target token rate (prompt + output tokens per second); within a bucket, arrivals are a
  Poisson process. The trace is replayed from its start and wraps after its hour.
* Offline: 20 queries at time 0, then more whenever the most used layer's estimated KV usage is
  at most 0.8 and nothing is waiting for a route (Helix's offline feeding rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from p2pserve.helix.root import data_root

BUCKET_S = 3.0


@lru_cache(maxsize=None)
def _read_pairs(path: str) -> tuple[np.ndarray, np.ndarray]:
    data = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.int64, ndmin=2)
    return data[:, 0].copy(), data[:, 1].copy()


def load_lengths(name: str = "azure_conv", root: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Input and output lengths of ``traces/<name>_lengths.csv`` (or a path to such a csv).

    ``root``: the Helix data root (None: the default, see ``p2pserve.helix.root``).
    """
    path = Path(name)
    if not path.exists():
        path = (root or data_root()) / "traces" / f"{name}_lengths.csv"
    return _read_pairs(str(path))


def load_arrival_counts(name: str = "azure_conv", root: Path | None = None) -> np.ndarray:
    """Arrivals per 3 s bucket from ``traces/<name>_arrivals_per_3s.csv`` under the data root."""
    path = (root or data_root()) / "traces" / f"{name}_arrivals_per_3s.csv"
    data = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float64, ndmin=2)
    return data[:, 1].copy()


@dataclass
class LengthSampler:
    """Draws (input_len, output_len) pairs uniformly from a trace with a seeded generator."""

    inputs: np.ndarray
    outputs: np.ndarray
    rng: np.random.Generator

    def draw(self, n: int) -> list[tuple[int, int]]:
        """``n`` pairs (with replacement)."""
        idx = self.rng.integers(0, len(self.inputs), size=n)
        return list(zip(self.inputs[idx].tolist(), self.outputs[idx].tolist()))

    def mean_tokens(self) -> float:
        """Mean input + output tokens of a query in the trace."""
        return float(self.inputs.mean() + self.outputs.mean())


def online_arrival_times(
    counts: np.ndarray,
    token_rate: float,
    mean_tokens_per_query: float,
    until: float,
    rng: np.random.Generator,
    bucket_s: float = BUCKET_S,
) -> np.ndarray:
    """Arrival times in ``[0, until)`` following ``counts`` rescaled to ``token_rate``.

    The scale makes the trace's mean query rate equal ``token_rate / mean_tokens_per_query``;
    bucket ``i`` then has Poisson(count_i * scale) arrivals placed uniformly inside it.
    """
    target_qps = token_rate / mean_tokens_per_query
    scale = target_qps / (counts.mean() / bucket_s)
    n_buckets = int(np.ceil(until / bucket_s))
    reps = int(np.ceil(n_buckets / len(counts)))
    lam = np.tile(counts, reps)[:n_buckets] * scale
    per_bucket = rng.poisson(lam)
    starts = np.repeat(np.arange(n_buckets) * bucket_s, per_bucket)
    times = np.sort(starts + rng.random(len(starts)) * bucket_s)
    return times[times < until]


@dataclass(frozen=True)
class OfflineFeeding:
    """Helix's offline rule: ``initial`` queries, then top up while usage <= ``max_usage``."""

    initial: int = 20
    max_usage: float = 0.8
