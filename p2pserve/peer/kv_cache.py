"""Per-session KV cache and the peer's KV memory budget.

Each session reserves ``max_length × layers in its span`` token-layer slots when it opens, so a
full peer refuses new sessions with a typed "overloaded" error instead of running out of memory
mid-generation. Buffers grow geometrically up to the reservation, so short sessions stay small.
"""

from __future__ import annotations

import threading

import torch

from p2pserve.errors import BadRequestError, OverloadedError


class SequenceCache:
    """K/V of one session for layers [start, end): per layer [nKV, capacity, D] buffers."""

    def __init__(self, start: int, end: int, num_kv_heads: int, head_dim: int, max_length: int, dtype, device="cpu"):
        self.start, self.end = start, end
        self.max_length = max_length
        self._shape = (num_kv_heads, head_dim)
        self._dtype = dtype
        self._device = device
        self._k: list[torch.Tensor | None] = [None] * (end - start)
        self._v: list[torch.Tensor | None] = [None] * (end - start)
        self._len = [0] * (end - start)

    @property
    def length(self) -> int:
        """Tokens cached in the span's first layer (all layers agree between steps)."""
        return self._len[0]

    def truncate(self, length: int) -> None:
        """Forget positions >= length (a client rewinding, e.g. to regenerate a turn)."""
        for i in range(len(self._len)):
            self._len[i] = min(self._len[i], length)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([nKV, n, D]) for ``layer``; return views of all cached [nKV, c+n, D]."""
        i = layer - self.start
        n = k.shape[1]
        old = self._len[i]
        new = old + n
        if new > self.max_length:
            raise BadRequestError(f"session exceeds its declared max_length {self.max_length}")
        buf_k = self._k[i]
        if buf_k is None or buf_k.shape[1] < new:
            cap = min(self.max_length, max(new, 2 * (buf_k.shape[1] if buf_k is not None else 16)))
            nkv, d = self._shape
            grown_k = torch.empty(nkv, cap, d, dtype=self._dtype, device=self._device)
            grown_v = torch.empty(nkv, cap, d, dtype=self._dtype, device=self._device)
            if buf_k is not None and old:
                grown_k[:, :old] = buf_k[:, :old]
                grown_v[:, :old] = self._v[i][:, :old]
            self._k[i], self._v[i] = grown_k, grown_v
        self._k[i][:, old:new] = k
        self._v[i][:, old:new] = v
        self._len[i] = new
        return self._k[i][:, :new], self._v[i][:, :new]


class KVBudget:
    """Token-layer slots the peer may hand out; thread-safe reservations."""

    def __init__(self, capacity_token_layers: int):
        self.capacity = int(capacity_token_layers)
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    @property
    def free(self) -> int:
        return self.capacity - self._used

    @property
    def free_fraction(self) -> float:
        return self.free / self.capacity if self.capacity else 0.0

    def reserve(self, amount: int) -> None:
        """Take ``amount`` slots or raise OverloadedError saying how much is missing."""
        with self._lock:
            if amount > self.capacity:
                raise BadRequestError(
                    f"session needs {amount} KV token-layers but this peer's whole budget is {self.capacity}"
                )
            if self._used + amount > self.capacity:
                raise OverloadedError(
                    f"KV cache full: need {amount} token-layers, {self.capacity - self._used} free "
                    f"of {self.capacity}; retry on another peer"
                )
            self._used += amount

    def release(self, amount: int) -> None:
        """Return slots taken by ``reserve``."""
        with self._lock:
            self._used = max(0, self._used - amount)
