"""The peer's KV memory as one pool of fixed-size blocks, and its budget in token-layers.

A block holds ``block_size`` consecutive tokens of one layer, K and V. Sessions take blocks as
they grow (`p2pserve.peer.kv_cache.PagedCache`), so the budget counts what is used, not a
worst-case reservation. All of the peer's sessions share one storage pair, K and V, each
``[num_blocks * block_size + 1, nKV, D]`` (token-major, so a step's new keys ``[T, nKV, D]`` are
written with one ``index_copy_``); the extra last row is zeros, the slot that padded positions
of a batched attention call read (garbage from ``torch.empty`` could be NaN, and NaN survives
a mask).

The storage is made with ``torch.empty`` on first use: on CPU the operating system commits the
pages of a block only when it is first written; blocks are handed out lowest id first and freed
ones are reused first, so a lightly loaded peer touches little of its budget.
"""

from __future__ import annotations

import threading

import torch

from p2pserve.errors import BadRequestError, OverloadedError
from p2pserve.peer.prefix_share import PrefixIndex

#: Tokens per block. Small blocks waste little at a session's tail (on average half a block per
#: layer); the gather index is one entry per token whatever the size.
BLOCK_SIZE = 16


class KVBudget:
    """The peer's KV pool: ``capacity`` token-layers in blocks of ``block_size``; thread-safe.

    ``used``/``free``/``free_fraction`` count token-layers (whole blocks) held by sessions; they are
    what the peer announces (``kv_free_tokens``) and what its batcher throttles prefill by.
    """

    def __init__(self, capacity_token_layers: int, block_size: int = BLOCK_SIZE):
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.num_blocks = int(capacity_token_layers) // block_size
        self.capacity = self.num_blocks * block_size
        self._used = 0
        self._free_ids = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out the lowest id
        self._refs = [0] * self.num_blocks  # sessions holding each block (>1: a shared prefix block)
        self.prefixes = PrefixIndex()  # full blocks by content key (peer/prefix_share.py)
        self._lock = threading.Lock()
        self.k: torch.Tensor | None = None  # [num_blocks * block_size + 1, nKV, D] once bound
        self.v: torch.Tensor | None = None
        self.pad_slot = self.num_blocks * block_size  # the zero row padded reads point at
        # Batched attention mode (model/attention.py): None = exact (bit-identical) in fp32 and
        # one padded call per layer in half precision; True/False force one.
        self.exact: bool | None = None

    @property
    def used(self) -> int:
        return self._used

    @property
    def free(self) -> int:
        return self.capacity - self._used

    @property
    def free_fraction(self) -> float:
        return self.free / self.capacity if self.capacity else 0.0

    def bind(self, num_kv_heads: int, head_dim: int, dtype, device="cpu", v_dim: int | None = None) -> None:
        """Make the storage (once); a pool serves one model, so later calls must agree.

        V rows are ``v_dim`` wide when given (latent attention: K rows hold the compressed
        latent, V rows the shared rotary key; `ModelSpec.kv_layout`), else ``head_dim``."""
        shape = (self.pad_slot + 1, num_kv_heads, head_dim)
        v_shape = shape if v_dim is None else (self.pad_slot + 1, num_kv_heads, v_dim)
        if self.k is not None:
            if tuple(self.k.shape) != shape or tuple(self.v.shape) != v_shape or self.k.dtype != dtype:
                raise ValueError(f"KV pool already bound to {tuple(self.k.shape)} {self.k.dtype}")
            return
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(v_shape, dtype=dtype, device=device)
        self.k[self.pad_slot].zero_()
        self.v[self.pad_slot].zero_()

    def take(self, count: int) -> list[int]:
        """``count`` free block ids, or OverloadedError ("KV cache full") and nothing taken."""
        amount = count * self.block_size
        with self._lock:
            if amount > self.capacity:
                raise BadRequestError(
                    f"a session needs {amount} KV token-layers but this peer's whole pool is {self.capacity}"
                )
            if self._used + amount > self.capacity or len(self._free_ids) < count:
                raise OverloadedError(
                    f"KV cache full: need {amount} token-layers, {self.capacity - self._used} free "
                    f"of {self.capacity}; retry on another peer"
                )
            self._used += amount
            ids = [self._free_ids.pop() for _ in range(count)]
            for i in ids:
                self._refs[i] = 1
            return ids

    def give(self, ids: list[int]) -> None:
        """Let go of blocks taken by :meth:`take` or :meth:`adopt`; a block is free once no
        session holds it (and its prefix entry goes with it)."""
        if not ids:
            return
        with self._lock:
            freed = []
            for i in ids:
                self._refs[i] -= 1
                if self._refs[i] == 0:
                    freed.append(i)
                    self.prefixes.forget(i)
            self._used = max(0, self._used - len(freed) * self.block_size)
            self._free_ids.extend(sorted(freed, reverse=True))

    def share(self, ids: list[int]) -> None:
        """Hold blocks another session holds once more (a fork: ``PagedCache.fork``)."""
        with self._lock:
            for i in ids:
                if self._refs[i] <= 0:
                    raise ValueError(f"block {i} is not held by anyone")
            for i in ids:
                self._refs[i] += 1

    def refs(self, block: int) -> int:
        """How many sessions hold ``block``."""
        return self._refs[block]

    def adopt(self, key: bytes, mine: tuple[int, ...]) -> tuple[int, ...]:
        """A session's full prefix block ``mine`` (one id per layer) has content key ``key``:
        the ids it should hold from now on. The first holder's blocks become the entry; a later
        one gets the entry's blocks (held once more) and its own are given back."""
        with self._lock:
            found = self.prefixes.get(key)
            if found is None or len(found) != len(mine):
                if not any(self.prefixes.registered(i) for i in mine):
                    self.prefixes.add(key, mine)
                return mine
            if found == mine:
                return mine
            for i in found:
                self._refs[i] += 1
        self.give(list(mine))
        return found

    def before_write(self, block: int) -> bool:
        """A session is about to write into ``block``: True if others hold it too (the writer
        must copy it first); else its prefix entry, if any, is dropped (its content changes)."""
        with self._lock:
            if self._refs[block] > 1:
                return True
            self.prefixes.forget(block)
            return False

    def reserve(self, amount: int) -> None:
        """Count ``amount`` token-layers as used without handing out blocks (callers that keep
        their own contiguous storage, e.g. a profiler's `SequenceCache`); OverloadedError if full."""
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
        """Return token-layers counted by :meth:`reserve`."""
        with self._lock:
            self._used = max(0, self._used - amount)
