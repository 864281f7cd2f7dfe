"""Per-layer batch latency as O(1) table lookups.

The Helix profiles give milliseconds per ONE layer against batch tokens, to be interpolated
linearly. A node evaluates this for every layer of every batch, so we tabulate the interpolated
values once per (model, GPU type) for every integer batch size up to a bound, in seconds, and
fall back to the interpolating profile beyond it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from p2pserve.helix.format import load_profile
from p2pserve.placement.profile import LatencyProfile

#: Tabulate prompt batches up to this many tokens (A100's cap is 3 x 2048).
PROMPT_TABLE_TOKENS = 8192
#: Tabulate decode batches up to this many tokens (largest decode cap in the data is 480).
DECODE_TABLE_TOKENS = 2048


@dataclass(frozen=True)
class LayerLatency:
    """Seconds for one layer to run a batch, by prompt tokens and by decode tokens.

    ``prompt_s[n]`` / ``decode_s[n]`` are exact for ``n`` within the tables; use
    :meth:`prompt` / :meth:`decode` for any size.
    """

    prompt_s: tuple[float, ...]
    decode_s: tuple[float, ...]
    profile: LatencyProfile | None = None

    def prompt(self, tokens: int) -> float:
        """Seconds for one layer to prefill ``tokens`` prompt tokens."""
        if tokens < len(self.prompt_s):
            return self.prompt_s[tokens]
        assert self.profile is not None
        return self.profile.prompt_ms(tokens) / 1000.0

    def decode(self, tokens: int) -> float:
        """Seconds for one layer to run ``tokens`` decode tokens (no single-token doubling)."""
        if tokens < len(self.decode_s):
            return self.decode_s[tokens]
        assert self.profile is not None
        return self.profile.decode_ms(tokens) / 1000.0

    @classmethod
    def from_points(
        cls, prompt_points: list[tuple[float, float]], decode_points: list[tuple[float, float]]
    ) -> "LayerLatency":
        """Build from ``(tokens, ms)`` rows (used by tests for hand-computable profiles)."""
        prof = LatencyProfile(
            tuple(float(x) for x, _ in prompt_points),
            tuple(float(y) for _, y in prompt_points),
            tuple(float(x) for x, _ in decode_points),
            tuple(float(y) for _, y in decode_points),
        )
        return cls.from_profile(prof)

    @classmethod
    def from_profile(cls, prof: LatencyProfile) -> "LayerLatency":
        """Tabulate an interpolating profile (milliseconds) into seconds per integer size."""
        return cls(
            tuple(prof.prompt_ms(n) / 1000.0 for n in range(PROMPT_TABLE_TOKENS + 1)),
            tuple(prof.decode_ms(n) / 1000.0 for n in range(DECODE_TABLE_TOKENS + 1)),
            prof,
        )


@lru_cache(maxsize=None)
def layer_latency(model: str, gpu_type: str, root: Path | None = None) -> LayerLatency:
    """Tabulated latency of ``gpu_type`` for ``model`` from the Helix profiles (cached).

    ``root``: the Helix data root (None: the default, see ``p2pserve.helix.root``).
    """
    return LayerLatency.from_profile(load_profile(model, gpu_type, root))
