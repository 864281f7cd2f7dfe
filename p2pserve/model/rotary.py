"""Rotary rows: the model's own rotary module turned into the tables `fast_ops.rope` applies.

The shard asks the family's rotary module (transformers' own, so every rope type it knows, YaRN
and longrope included) for cos and sin at some positions and reshapes them once for every head:
cos [T, 1, D] and a signed sin [T, 1, D] whose first half is negated, so that rotating is
``x * cos + roll(x, D/2) * sin_signed`` with no per-layer negation (`fast_ops.rope`).
"""

from __future__ import annotations

import torch

# Rope types whose frequencies depend on the largest position they are given: no shared table.
_DYNAMIC_ROPE = ("dynamic", "longrope")


def is_dynamic_rope(rotary) -> bool:
    """Whether ``rotary`` (a rotary module) picks its frequencies from the positions of each call."""
    rope_type = getattr(rotary, "rope_type", "default")
    return not isinstance(rope_type, str) or any(t in rope_type for t in _DYNAMIC_ROPE)


def rotary_rows(rotary, positions: torch.Tensor, like: torch.Tensor,
                half_table: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary``'s cos, sin for ``positions`` [T], as [T, 1, D] cos and sin_signed.

    ``half_table``: the module returns one cos/sin per frequency ([.., D/2], GPT-OSS) and turns
    both halves of each head by them; they are doubled into the [.., D] table the others return."""
    cos, sin = rotary(like[None], positions[None])
    cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [T, 1, D] ([T, 1, D/2]: one per frequency)
    if half_table:  # both halves of a head turn by the same angles
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
