"""Hidden-state rows as evidence reads them: bytes widened to float32, and the relative row distance
that tolerances are stated in (pure numpy; the client computes the same in torch)."""

from __future__ import annotations

import numpy as np


def rows_of(dtype: str, payload: bytes, count: int) -> np.ndarray:
    """Hidden-state bytes as float32 rows [count, width] (bfloat16 widened bit-exactly)."""
    if dtype == "bfloat16":
        values = (np.frombuffer(payload, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif dtype in ("float32", "float16"):
        values = np.frombuffer(payload, dtype=np.float32 if dtype == "float32" else np.float16).astype(np.float32)
    else:
        raise ValueError(f"no hidden states of dtype {dtype}")
    if count <= 0 or values.size % count:
        raise ValueError(f"{values.size} values do not split into {count} rows")
    return values.reshape(count, -1)


def row_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Largest relative L2 error over rows, ``|a - b| / |b|`` (0 for identical rows)."""
    if a.shape != b.shape:
        return float("inf")
    den = np.maximum(np.linalg.norm(b, axis=-1), 1e-6)
    d = np.linalg.norm(a - b, axis=-1) / den
    return float(np.nan_to_num(d, nan=np.inf).max()) if d.size else 0.0
