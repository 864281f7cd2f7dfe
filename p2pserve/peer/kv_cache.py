"""Per-session KV caches: paged over the peer's block pool, or contiguous.

`PagedCache` is what a peer's sessions use: a block table per layer into the shared
`KVBudget` pool, grown a block at a time as the session's tokens arrive and shrunk when the
client rewinds, so the budget holds what sessions use (see docs/kv-cache.md). A session that
outgrows the free blocks gets OverloadedError ("KV cache full") before any of its step runs.
Sessions whose inputs agree on a prefix share its full blocks, copy-on-write
(`PagedCache.note_written`, peer/prefix_share.py).
`SequenceCache` keeps one contiguous buffer per layer; tests and benchmarks compare against it.
"""

from __future__ import annotations

import torch

from p2pserve.errors import BadRequestError
from p2pserve.peer.block_pool import BLOCK_SIZE, KVBudget
from p2pserve.peer.prefix_share import chain_next, chain_root, row_digests

__all__ = ["BLOCK_SIZE", "KVBudget", "PagedCache", "SequenceCache"]


class SequenceCache:
    """K/V of one session for layers [start, end): per layer [nKV, capacity, D] buffers (V's
    width is ``v_dim`` when given: latent attention caches a latent and a rotary key there)."""

    def __init__(self, start: int, end: int, num_kv_heads: int, head_dim: int, max_length: int, dtype, device="cpu",
                 v_dim: int | None = None):
        self.start, self.end = start, end
        self.max_length = max_length
        self._shape = (num_kv_heads, head_dim, head_dim if v_dim is None else v_dim)
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
            nkv, d, dv = self._shape
            grown_k = torch.empty(nkv, cap, d, dtype=self._dtype, device=self._device)
            grown_v = torch.empty(nkv, cap, dv, dtype=self._dtype, device=self._device)
            if buf_k is not None and old:
                grown_k[:, :old] = buf_k[:, :old]
                grown_v[:, :old] = self._v[i][:, :old]
            self._k[i], self._v[i] = grown_k, grown_v
        self._k[i][:, old:new] = k
        self._v[i][:, old:new] = v
        self._len[i] = new
        return self._k[i][:, :new], self._v[i][:, :new]


class PagedCache:
    """K/V of one session for layers [start, end), in blocks of the peer's pool.

    ``_tables[i]`` lists the block ids of layer start+i in position order; position p of that
    layer lives in the pool's row ``table[p // B] * B + p % B``. Every layer of the span holds
    the same number of blocks (``reserve`` grows them together), so one tensor
    ``_table_t`` [layers, blocks] serves the gather of all layers at once.
    """

    def __init__(self, pool: KVBudget, start: int, end: int, max_length: int, salt: bytes = b""):
        self.pool, self.start, self.end, self.max_length = pool, start, end, max_length
        self.salt = salt  # the prefix chain's scope (peer/prefix_share.py: scope_salt)
        self._tables: list[list[int]] = [[] for _ in range(end - start)]
        self._table_t = torch.empty(end - start, 0, dtype=torch.long)
        self._len = [0] * (end - start)
        self._offsets = torch.arange(pool.block_size)
        self._rows: tuple[int, torch.Tensor] | None = None  # (length, slots(length)) of the step running
        # Prefix sharing (peer/prefix_share.py): a digest per input position received, a chain
        # key per full block; blocks [0, _adopted) went through the pool's index and may be
        # shared with other sessions, so writing into one copies it first.
        self._digests: list[bytes] | None = []
        self._chain: list[bytes] = []
        self._root: bytes | None = None
        self._adopted = 0

    @property
    def length(self) -> int:
        """Tokens cached in the span's first layer (all layers agree between steps)."""
        return self._len[0]

    @property
    def held(self) -> int:
        """Token-layers of the pool this session holds (whole blocks)."""
        return len(self._tables[0]) * (self.end - self.start) * self.pool.block_size

    def reserve(self, length: int) -> None:
        """Hold blocks for positions [0, length) in every layer; OverloadedError when the pool
        lacks them (nothing taken), BadRequestError beyond the declared max_length."""
        if length > self.max_length:
            raise BadRequestError(f"session exceeds its declared max_length {self.max_length}")
        B = self.pool.block_size
        old = self._len[0]
        # Writing into block old // B, which may be shared with other sessions: copy it first.
        into_adopted = length > old and old % B != 0 and old // B < self._adopted
        cow = []
        if into_adopted:  # (a block only this session holds just leaves the index)
            cow = [i for i, table in enumerate(self._tables) if self.pool.before_write(table[old // B])]
        more = max(0, -(-length // B) - len(self._tables[0]))
        if not more and not cow:
            if into_adopted:
                self._adopted = old // B
            return
        ids = self.pool.take(more * len(self._tables) + len(cow))  # all or nothing
        if cow:
            self._copy_on_write(old // B, cow, ids[more * len(self._tables):])
        elif into_adopted:
            self._adopted = old // B
        for i, table in enumerate(self._tables):
            table.extend(ids[i * more : (i + 1) * more])
        self._table_t = torch.tensor(self._tables, dtype=torch.long)
        self._rows = None

    def fork(self, parent: "PagedCache", length: int) -> None:
        """Start (empty) holding ``parent``'s positions [0, length): its blocks are shared, so
        both sessions copy the block they first write into when the other holds it too.

        The caller makes sure ``parent`` runs no step meanwhile (its tables are read here)."""
        if self.length or not 0 < length <= parent.length or (parent.start, parent.end) != (self.start, self.end):
            raise BadRequestError(f"cannot fork positions [0, {length}) of a session holding {parent.length}")
        B = self.pool.block_size
        blocks = -(-length // B)
        self._tables = [table[:blocks] for table in parent._tables]
        self.pool.share([b for table in self._tables for b in table])
        self._table_t = torch.tensor(self._tables, dtype=torch.long)
        self._len = [length] * len(self._tables)
        self._rows = None
        self._digests = parent._digests[:length] if parent._digests is not None and parent.salt == self.salt else None
        self._chain = parent._chain[: length // B] if self._digests is not None else []
        self._root = parent._root if self._digests is not None else None
        # every shared block counts as possibly shared: the first write into one copies it
        self._adopted = blocks
        parent._adopted = max(parent._adopted, blocks)

    def truncate(self, length: int) -> None:
        """Forget positions >= length and give back the blocks past its block (a client rewinding)."""
        length = max(0, length)
        for i in range(len(self._len)):
            self._len[i] = min(self._len[i], length)
        keep = -(-length // self.pool.block_size)
        if self._digests is not None:
            del self._digests[length:]
        del self._chain[length // self.pool.block_size:]
        self._adopted = min(self._adopted, keep)
        if keep < len(self._tables[0]):
            freed = [b for table in self._tables for b in table[keep:]]
            self._tables = [table[:keep] for table in self._tables]
            self._table_t = self._table_t[:, :keep].contiguous()
            self._rows = None
            self.pool.give(freed)

    def release(self) -> None:
        """Give every block back (the session closed)."""
        self.truncate(0)

    def _copy_on_write(self, b: int, layers: list[int], fresh: list[int]) -> None:
        """Block ``b`` of ``layers`` is held by other sessions too: copy it into the ``fresh``
        blocks, which this session writes into from now on, and let go of the shared ones."""
        B, pool = self.pool.block_size, self.pool
        shared = []
        for i, new in zip(layers, fresh):
            old = self._tables[i][b]
            pool.k[new * B : (new + 1) * B] = pool.k[old * B : (old + 1) * B]
            pool.v[new * B : (new + 1) * B] = pool.v[old * B : (old + 1) * B]
            self._tables[i][b] = new
            shared.append(old)
        pool.give(shared)
        self._adopted = b

    def note_written(self, inputs: torch.Tensor, position: int) -> None:
        """The step wrote positions [position, position + n) from ``inputs`` ([n] token ids or
        [n, H] hidden states, as received): key the blocks it filled by content and share those
        another session already holds (see peer/prefix_share.py)."""
        if self._digests is None:
            return
        if len(self._digests) != position:  # out of step with the cache: stop sharing this session
            self._digests = None
            return
        if self._root is None:
            self._root = chain_root(self.start, self.end, inputs.dtype, self.salt)
        self._digests += row_digests(inputs)
        B = self.pool.block_size
        full = min(self._len[0], len(self._digests)) // B
        changed = False
        while len(self._chain) < full:
            b = len(self._chain)
            key = chain_next(self._chain[-1] if self._chain else self._root, self._digests[b * B : (b + 1) * B])
            self._chain.append(key)
            mine = tuple(table[b] for table in self._tables)
            held = self.pool.adopt(key, mine)
            if held != mine:
                for table, block in zip(self._tables, held):
                    table[b] = block
                changed = True
            self._adopted = max(self._adopted, b + 1)
        if changed:
            self._table_t = torch.tensor(self._tables, dtype=torch.long)
            self._rows = None

    def slots(self, stop: int) -> torch.Tensor:
        """Pool rows of positions [0, stop) of every layer of the span: [layers, stop]."""
        rows = self._table_t[:, :, None] * self.pool.block_size + self._offsets  # [layers, blocks, B]
        return rows.reshape(len(self._tables), -1)[:, :stop]

    def claim(self, n: int) -> tuple[int, int]:
        """Room for ``n`` more tokens in every layer, counted as written: (old, new) length.

        The batched attention path writes all layers of a step through precomputed slots, so
        it advances the lengths once per step instead of once per layer."""
        old = self._len[0]
        self.reserve(old + n)
        self._len = [old + n] * len(self._len)
        return old, old + n

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([nKV, n, D]) for ``layer``; return copies of all cached [nKV, c+n, D]."""
        i = layer - self.start
        old = self._len[i]
        new = old + k.shape[1]
        self.reserve(new)
        if self._rows is None or self._rows[0] != new:  # every layer of a step has the same length
            self._rows = (new, self.slots(new).to(self.pool.k.device))
        rows = self._rows[1][i]  # [c+n]
        self.pool.k.index_copy_(0, rows[old:], k.transpose(0, 1))
        self.pool.v.index_copy_(0, rows[old:], v.transpose(0, 1))
        self._len[i] = new
        k_rows, v_rows = self.pool.k.view(self.pool.k.shape[0], -1), self.pool.v.view(self.pool.v.shape[0], -1)
        # index_select on 2-D rows: the fast gather on CPU (V may be narrower than K: latent attention)
        keys = k_rows.index_select(0, rows).view(new, k.shape[0], k.shape[2]).transpose(0, 1)
        return keys, v_rows.index_select(0, rows).view(new, v.shape[0], v.shape[2]).transpose(0, 1)
