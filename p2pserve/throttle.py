"""gLLM's token throttling formula, shared by the peer's batcher and the simulator. Pure.

Prefill: ``#P = max(min(#WP/#T, #MaxP·(KVfree−KVthresh)/(1−KVthresh)), #MinP)`` — waiting prompt
tokens spread over ``#T`` batches, shrunk as free KV cache runs low, never under ``#MinP``.
Decode: ``#D = #RD / depth`` — the running decodes split into one micro-batch per pipeline stage.
"""

from __future__ import annotations

import math


def prefill_budget(waiting_tokens: float, kv_free: float, *, iterations: int, max_prefill: int,
                   min_prefill: int, kv_thresh: float, whole_spread: bool = True) -> int:
    """``#P`` of the module docstring; ``whole_spread`` rounds ``#WP/#T`` up to whole tokens
    (the peer does; the simulator divides exactly, as its published figures were measured)."""
    spread = waiting_tokens / max(1, iterations)
    if whole_spread:
        spread = math.ceil(spread)
    kv_term = max_prefill * (kv_free - kv_thresh) / (1.0 - kv_thresh)
    return int(max(min(spread, kv_term), min_prefill))


def decode_budget(running: int, depth: float) -> int:
    """``#D`` of the module docstring: at least one (also with no running decode or no depth)."""
    if running and depth > 0:
        return max(1, math.ceil(running / depth))
    return 1
