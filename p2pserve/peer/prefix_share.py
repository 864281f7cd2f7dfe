"""Prefix sharing: sessions whose inputs agree on a prefix share its KV blocks, copy-on-write.

The key of a block is what the peer itself received, never anything a client names: a hash
chain over the span's input rows (token ids on the first hop, the hidden-state bytes on later
hops), so ``chain[b] = sha256(chain[b-1] || digest(row) for the block's rows)`` with ``chain[-1]``
naming the span and the inputs' dtype. Keys and values of positions [0, p) of every layer of
a span are a function of the span's inputs at [0, p) alone (attention is causal), so two
sessions with equal chains up to a full block hold the same keys and values there, and one copy
serves both. A client that wants another session's blocks must send that session's very
inputs, which gives it nothing it could not compute; one that rewinds into a shared block
writes into its own copy (`PagedCache` copies a block before writing into it when another
session holds it too).

Only full blocks are shared. An entry lives as long as some session holds its blocks.
"""

from __future__ import annotations

import hashlib

import torch


def row_digests(inputs: torch.Tensor) -> list[bytes]:
    """sha256 of each input row as received: [n] token ids or [n, H] hidden states."""
    rows = inputs.detach().to("cpu").contiguous().reshape(inputs.shape[0], -1).view(torch.uint8).numpy()
    return [hashlib.sha256(r.tobytes()).digest() for r in rows]


def chain_root(start: int, end: int, dtype: torch.dtype) -> bytes:
    """The chain's seed: the span and the dtype of its inputs (tokens vs hidden states)."""
    return hashlib.sha256(f"p2pserve-kv-prefix|{start}|{end}|{dtype}".encode()).digest()


def chain_next(previous: bytes, digests: list[bytes]) -> bytes:
    """The key of a full block: the previous key and the digests of the block's rows."""
    h = hashlib.sha256(previous)
    for d in digests:
        h.update(d)
    return h.digest()


class PrefixIndex:
    """Chain key -> the block ids (one per layer of the span) that hold that prefix block.

    Not locked itself: `KVBudget` calls it under its lock.
    """

    def __init__(self):
        self._by_key: dict[bytes, tuple[int, ...]] = {}
        self._key_of: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: bytes) -> tuple[int, ...] | None:
        return self._by_key.get(key)

    def add(self, key: bytes, ids: tuple[int, ...]) -> None:
        self._by_key[key] = ids
        for i in ids:
            self._key_of[i] = key

    def registered(self, block: int) -> bool:
        return block in self._key_of

    def forget(self, block: int) -> None:
        """Drop the entry holding ``block`` (freed, or about to be overwritten by its sole owner)."""
        key = self._key_of.pop(block, None)
        if key is not None:
            for i in self._by_key.pop(key, ()):
                self._key_of.pop(i, None)
