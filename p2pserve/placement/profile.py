"""A node's measured per-layer latency against batch size: the planner's view of a GPU's speed.

The estimate (:mod:`estimate`) and the simulator read it; where it comes from is not the
planner's business (``p2pserve.helix`` builds one from the Helix artifact's csv profiles).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


def interpolate(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise-linear interpolation; beyond the last row extrapolate with the last slope."""
    if x <= xs[0]:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    if i >= len(xs):
        # Extrapolate linearly from the last segment: batches bigger than profiled cost more.
        x0, x1, y0, y1 = xs[-2], xs[-1], ys[-2], ys[-1]
        slope = (y1 - y0) / (x1 - x0) if x1 != x0 else 0.0
        return y1 + max(slope, 0.0) * (x - x1)
    if xs[i] == x:
        return ys[i]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class LatencyProfile:
    """Milliseconds for ONE layer to run a batch, as measured points ``(tokens, ms)``.

    Prompt points are against the batch's total prompt tokens, decode points against its number
    of decode tokens; both sorted by tokens. Between points the cost is interpolated linearly.
    """

    prompt_tokens: tuple[float, ...]
    prompt_ms_values: tuple[float, ...]
    decode_tokens: tuple[float, ...]
    decode_ms_values: tuple[float, ...]

    def prompt_ms(self, tokens: float) -> float:
        """Milliseconds for one layer to prefill a batch of ``tokens`` prompt tokens."""
        return interpolate(self.prompt_tokens, self.prompt_ms_values, tokens)

    def decode_ms(self, tokens: float) -> float:
        """Milliseconds for one layer to decode a batch of ``tokens`` decode tokens."""
        return interpolate(self.decode_tokens, self.decode_ms_values, tokens)
