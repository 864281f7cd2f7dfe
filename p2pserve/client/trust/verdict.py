"""The pure verdict of a check: how far two replicas' hidden rows are apart, and who three
replicas outvote."""

from __future__ import annotations

from typing import Optional

import torch


def row_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Relative L2 error of each row of two [n, hidden] tensors: [n]."""
    a, b = a.float(), b.float()
    return torch.linalg.vector_norm(a - b, dim=-1) / torch.linalg.vector_norm(b, dim=-1).clamp_min(1e-6)


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest relative L2 error over rows of two [n, hidden] tensors (0 for identical)."""
    return float(row_distances(a, b).max()) if a.numel() else 0.0


def culprit(agree_aw: bool, agree_at: Optional[bool], agree_wt: Optional[bool]) -> Optional[str]:
    """Who is wrong among accused, witness and third ("accused", "witness", "third") or None.

    ``agree_at``/``agree_wt`` are None without a third replica. Whoever disagrees with both
    others is outvoted; without a third opinion, or with three different answers, nobody is.
    """
    if agree_aw or agree_at is None or agree_wt is None:
        return None
    if agree_wt and not agree_at:
        return "accused"
    if agree_at and not agree_wt:
        return "witness"
    return None
