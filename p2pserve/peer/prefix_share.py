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

**Scope.** Whether a block is shared shows: the peer's free KV figure (``PeerStats``, which anyone
may ask for, and ``PeerInfo.kv_free_tokens``) drops by a block less, and the prefill is faster.
Shared across owners, a guessed 16-token block that matches another user's cached prompt is told
apart that way, one guess at a time. So by default the chain's root is salted with the owner
(``AdmissionConfig.prefix_sharing = "owner"``: the authenticated peer id behind the session's
stream), and only one owner's own sessions share (a chat's turns, a client's parallel requests).
A swarm whose users trust one another can opt into ``"global"`` sharing (one system prompt shared
by everyone); the free figures are then reported in steps of 1/64 of the capacity
(:func:`coarse_free`), which hides a single block but not from someone who can fill the pool to
a step's edge first: global sharing is for swarms that accept that.
"""

from __future__ import annotations

import hashlib

import torch


def row_digests(inputs: torch.Tensor) -> list[bytes]:
    """sha256 of each input row as received: [n] token ids or [n, H] hidden states."""
    rows = inputs.detach().to("cpu").contiguous().reshape(inputs.shape[0], -1).view(torch.uint8).numpy()
    return [hashlib.sha256(r.tobytes()).digest() for r in rows]


def chain_root(start: int, end: int, dtype: torch.dtype, salt: bytes = b"") -> bytes:
    """The chain's seed: the span, the dtype of its inputs (tokens vs hidden states), and the
    sharing scope's salt (the owner's peer id; empty for global sharing)."""
    return hashlib.sha256(f"p2pserve-kv-prefix|{start}|{end}|{dtype}|".encode() + salt).digest()


def scope_salt(scope: str, owner: str) -> bytes:
    """The salt of a session's chain: its owner's id, unless the peer shares globally."""
    if scope not in ("owner", "global"):
        raise ValueError(f"prefix sharing scope must be 'owner' or 'global', got {scope!r}")
    return b"" if scope == "global" else b"owner|" + owner.encode()


def coarse_free(free: int, capacity: int, scope: str) -> int:
    """A free KV figure as the peer tells others: exact when only owners share with themselves,
    rounded down to 1/64 of the capacity under global sharing."""
    step = max(1, capacity // 64) if scope == "global" else 1
    return free - free % step


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
