"""Attention of a batch of sequences, each against its own KV cache.

Two paths. `attend_each` appends to each sequence's `LayerCache` and runs one SDPA call per
sequence (any cache; a lone sequence always takes it, with the very shapes `generate` uses).
`PagedBatch` runs one SDPA call per layer for the whole batch when every cache is paged over
one pool (`PagedLayout`): the step's pool rows are computed once, then each layer is one
``index_copy_`` of the new K/V, one gather of every sequence's keys and values padded to the
longest, and one masked SDPA call.

Shapes: T = tokens in the batch, b = sequences, mq / mk = longest query / key length in the
batch, nH / nKV = query / key-value heads, D = head dim, S = pool rows.

Exactness: padding changes the length of SDPA's reductions (softmax sum, probabilities × V),
so a padded batch agrees with per-sequence attention only to rounding (about 1e-7 in fp32).
`PagedBatch`'s exact mode (fp32) instead groups sequences by shape and runs one call per group
with the lone-sequence shapes: bit-identical (tests/unit/peer/test_paged_kv.py).

Half precision on CPU: every SDPA call (`sdpa`) runs in fp32 on up-cast q, k, v and casts its
output back. CPU SDPA's reduced-precision kernel is 3-7x slower than its fp32 kernel on decode
shapes (one bf16 query of 9 heads against 500 keys of 3 heads: 475 against 88 us including the
casts, 1 thread); up-casting is exact (every bf16 value is an fp32 value) and the fp32 kernel
accumulates in fp32 as the bf16 one does internally, so the outputs agree to the output's rounding.
Every path (lone, grouped, padded) runs the same function, so one process and a swarm give the
same bits. On GPUs the native half-precision kernels are the fast ones and run unchanged. A CPU
half-precision step's decodes (two or more) instead run a kernel of `decode_attention`: in bf16
a C kernel that reads the pool rows in place, with no gathered or up-cast copy.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from p2pserve.model import decode_attention
from p2pserve.model.attention_sinks import sink_attention


class LayerCache(Protocol):
    """The KV storage of one sequence, as the shard sees it."""

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([nKV, n, D]) after the cached ones; return all keys and values [nKV, c+n, D]."""


class PagedLayout(Protocol):
    """A `LayerCache` whose layers live in rows of a pool shared with other sequences."""

    pool: object  # has .k, .v [S, nKV, D] and .pad_slot (a zero row)
    start: int

    def claim(self, n: int) -> tuple[int, int]:
        """Room for n more tokens in every layer of the span, counted written: (old, new) length."""

    def slots(self, stop: int) -> torch.Tensor:
        """Pool rows of positions [0, stop) of every layer of the span: [layers, stop]."""


def paged_pool(caches) -> object | None:
    """The one pool all ``caches`` are paged over, or None (then `attend_each` runs)."""
    pool = getattr(caches[0], "pool", None)
    if pool is None or getattr(pool, "k", None) is None:
        return None
    return pool if all(getattr(c, "pool", None) is pool for c in caches) else None


def paged_batch(segments) -> "PagedBatch | None":
    """Batched attention over the pool when every segment spans the same layers of one pool
    (else None: `attend_each`). Exact (grouped by shape, bit-identical) when the pool says so
    (``pool.exact``), by default in fp32; one padded call per layer otherwise."""
    pool = paged_pool([s.cache for s in segments])
    if pool is None or any((s.start, s.end) != (segments[0].start, segments[0].end) for s in segments):
        return None
    exact = getattr(pool, "exact", None)
    return PagedBatch(segments, pool, exact=pool.k.dtype == torch.float32 if exact is None else exact)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
         scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with grouped-query heads: q [b, nH, n, D], k and v
    [b, nKV, c, D] -> [b, nH, n, D]; half precision on CPU runs in fp32 (module docstring).
    With attention sinks (``sinks`` [nH], GPT-OSS) the softmax runs over the scores and one extra
    logit per head that no value follows (`attention_sinks.sink_attention`)."""
    if q.dtype != torch.float32 and q.device.type == "cpu":
        return sdpa(q.float(), k.float(), v.float(), mask, scale, sinks).to(q.dtype)
    if sinks is not None:
        return sink_attention(q, k, v, mask, scale, sinks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def attention_mask(n: int, total: int, window: int | None, device) -> torch.Tensor | None:
    """Boolean [n, total] mask: query i (absolute total-n+i) sees keys j <= its position.

    A single query token with no window sees the whole cache, so no mask is built for decode.
    """
    past = total - n
    if n == 1 and (window is None or total <= window):
        return None
    q_pos = torch.arange(past, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= (q_pos - k_pos) < window
    return mask


def _expanded(ks: torch.Tensor, vs: torch.Tensor, expand):
    """Cached rows [b, nKV, c, *] as SDPA's keys and values: as they are, or through ``expand``
    (latent attention: the latent and rotary key -> per-head keys and values)."""
    return (ks, vs) if expand is None else expand(ks, vs)


def attend_each(layer_idx: int, q, k, v, segments, scaling: float, window: int | None,
                sinks: torch.Tensor | None = None, expand=None) -> torch.Tensor:
    """Append k, v to each segment's cache and attend; q, k, v [T, heads, D] -> [T, nH * Dv]
    (``sinks`` [nH]: attention sinks, see `sdpa`; Dv: the values' width after ``expand``,
    see `_expanded`)."""
    if len(segments) == 1:  # the common case, without slicing
        n = q.shape[0]
        ks, vs = segments[0].cache.append(layer_idx, k.transpose(0, 1), v.transpose(0, 1))
        mask = attention_mask(n, ks.shape[1], window, q.device)
        ks, vs = _expanded(ks[None], vs[None], expand)
        o = sdpa(q.transpose(0, 1)[None], ks, vs, mask, scaling, sinks)  # [1, nH, n, Dv]
        # With one token, [1, nH, 1, D] flattens to [1, nH * D] without the transpose.
        return o.reshape(1, -1) if n == 1 else o[0].transpose(0, 1).reshape(n, -1)
    outs = []
    at = 0
    for seg in segments:
        n = seg.n
        qs = q[at : at + n].transpose(0, 1)  # [nH, n, D]
        ks, vs = seg.cache.append(layer_idx, k[at : at + n].transpose(0, 1), v[at : at + n].transpose(0, 1))
        mask = attention_mask(n, ks.shape[1], window, q.device)
        o = sdpa(qs[None], *_expanded(ks[None], vs[None], expand), mask, scaling, sinks)
        outs.append(o[0].transpose(0, 1).reshape(n, -1))
        at += n
    return torch.cat(outs)


class PagedBatch:
    """One step of several sequences paged over one pool: rows and masks, computed once.

    Building it claims each sequence's room for its new tokens (the only loop over sequences);
    `attend` then serves every layer with no per-sequence work. Two modes:

    * ``exact`` (fp32, the default there): sequences are grouped by their shape (new tokens,
      total length); each group is one SDPA call over unpadded keys, with the very shapes and
      mask a lone sequence uses, so every sequence's output is bit-identical to per-sequence
      attention (SDPA over a batch of equal shapes computes each member as alone; padding would
      lengthen the softmax and P×V reductions and change the last bit). A decode batch of
      sessions at one length is one call; sessions at distinct lengths cost one call each, as
      per-sequence attention does, but with one gather per group instead of per sequence.
    * padded (``exact=False``, half precision): one SDPA call per layer for the step's decodes
      and one for its prompt chunks (`_Padded`), each sequence's keys padded to the longest of
      its call (padding reads the pool's zero row) and masked; agrees with per-sequence
      attention to rounding.
    """

    def __init__(self, segments, pool, exact: bool = True):
        self.pool = pool
        self.segments = segments
        b = len(segments)
        lo, hi = min(s.start for s in segments), max(s.end for s in segments)
        self.lo = lo
        ns = [s.n for s in segments]
        spans = [s.cache.claim(s.n) for s in segments]  # [(past, total)]
        mk = max(total for _, total in spans)
        T = sum(ns)
        # Rows written ([layers, T]) and read ([layers, b, mk], padding -> the zero row) per layer.
        self.write = torch.full((hi - lo, T), pool.pad_slot, dtype=torch.long)
        self.read = torch.full((hi - lo, b, mk), pool.pad_slot, dtype=torch.long)
        groups: dict[tuple[int, int], list[int]] = {}  # (n, total) -> sequences of that shape
        at = 0
        starts = []
        for j, (seg, (past, total)) in enumerate(zip(segments, spans)):
            rows = seg.cache.slots(total)  # [span layers, total]
            a, z = seg.cache.start - lo, seg.cache.start - lo + rows.shape[0]
            self.write[a:z, at : at + seg.n] = rows[:, past:]
            self.read[a:z, j, :total] = rows
            groups.setdefault((seg.n, total), []).append(j)
            starts.append(at)
            at += seg.n
        dev = pool.k.device  # index tensors live with the pool (built on the host, moved once)
        self.write, self.read = self.write.to(dev), self.read.to(dev)
        self.groups = None
        self.parts: list[_Padded] = []
        if exact:
            self.groups = [_Group(n, total, members, starts, self.read[:, members, :total])
                           for (n, total), members in groups.items()]
            self.in_order = len(self.groups) == 1  # one group of the whole batch: tokens already in its order
        else:
            # Decodes apart from prompt chunks: padded together, every decode would run the
            # longest chunk's query rows (a 40-token chunk makes 32 decodes attend 32 x 40 rows).
            decodes = [j for j, n in enumerate(ns) if n == 1]
            others = [j for j, n in enumerate(ns) if n != 1]
            self.parts = [_Padded(m, ns, spans, starts, self.read, pool) for m in (decodes, others) if m]
            self.in_order = len(self.parts) == 1

    def attend(self, layer_idx: int, q, k, v, scaling: float, window: int | None,
               sinks: torch.Tensor | None = None, expand=None) -> torch.Tensor:
        """Write this layer's k, v [T, nKV, D] and attend q [T, nH, D]: -> [T, nH * Dv] (the
        cached rows go through ``expand`` first when given, see `_expanded`; ``sinks``: see `sdpa`)."""
        pool, i = self.pool, layer_idx - self.lo
        write = self.write[i]
        pool.k.index_copy_(0, write, k)
        pool.v.index_copy_(0, write, v)
        if self.groups is not None:
            return self._attend_groups(i, q, scaling, window, sinks, expand)
        if self.in_order:
            return self.parts[0].attend(pool, i, q, scaling, window, sinks, expand)
        out = None
        for part in self.parts:
            o = part.attend(pool, i, q.index_select(0, part.tokens), scaling, window, sinks, expand)
            out = q.new_empty(q.shape[0], o.shape[1]) if out is None else out
            out.index_copy_(0, part.tokens, o)
        return out

    def _attend_groups(self, i: int, q, scaling: float, window: int | None, sinks=None,
                       expand=None) -> torch.Tensor:
        """The exact mode: one SDPA call per group of equal shapes; q [T, nH, D] -> [T, nH * Dv]."""
        pool = self.pool
        T, nH, D = q.shape
        k_rows, v_rows = pool.k.view(pool.k.shape[0], -1), pool.v.view(pool.v.shape[0], -1)
        out = None
        # With several intra-op threads, CPU SDPA splits a lone decode query's keys across
        # threads, which a batch of them does not: the reduction order then depends on the
        # batch, so decode groups run member by member there (per-sequence cost, same bits).
        split = torch.get_num_threads() > 1
        for g in self.groups:
            size, n, total = len(g.members), g.n, g.total
            keys = k_rows.index_select(0, g.read[i].view(-1)).view(size, total, *pool.k.shape[1:]).transpose(1, 2)
            values = v_rows.index_select(0, g.read[i].view(-1)).view(size, total, *pool.v.shape[1:]).transpose(1, 2)
            keys, values = _expanded(keys, values, expand)  # [g, nKV | nH, total, D | Dv]
            qg = q if self.in_order else q.index_select(0, g.tokens)  # [g * n, nH, D], sequence-major
            qg = qg.view(size, n, nH, D).transpose(1, 2)  # [g, nH, n, D]
            mask = g.mask(window, q.device)
            if split and n == 1 and size > 1:
                o = torch.cat([sdpa(qg[j : j + 1], keys[j : j + 1], values[j : j + 1], mask, scaling, sinks)
                               for j in range(size)])
            else:
                o = sdpa(qg, keys, values, mask, scaling, sinks)  # [g, nH, n, Dv]
            Dv = o.shape[-1]
            o = o.reshape(size, nH * Dv) if n == 1 else o.transpose(1, 2).reshape(size * n, nH * Dv)
            if self.in_order:
                return o
            out = q.new_empty(T, nH * Dv) if out is None else out
            out.index_copy_(0, g.tokens, o)
        return out


class _Group:
    """Sequences of one step with equal shapes: ``n`` new tokens each, ``total`` keys each."""

    def __init__(self, n: int, total: int, members: list[int], starts: list[int], read: torch.Tensor):
        self.n, self.total, self.members = n, total, members
        self.read = read.contiguous()  # [layers, g, total] pool rows of every member's keys
        # Batch rows of the members' tokens, sequence-major: [g * n].
        self.tokens = torch.cat([torch.arange(starts[j], starts[j] + n) for j in members]).to(read.device)
        self._masks: dict[int | None, torch.Tensor | None] = {}

    def mask(self, window: int | None, device) -> torch.Tensor | None:
        """The lone-sequence mask ([n, total], or None for decode), shared by every member."""
        if window not in self._masks:
            self._masks[window] = attention_mask(self.n, self.total, window, device)
        return self._masks[window]


class _Padded:
    """Sequences of one step padded to their longest query and key length: one masked SDPA
    call per layer for all of them (the half-precision path)."""

    def __init__(self, members: list[int], ns: list[int], spans: list[tuple[int, int]], starts: list[int],
                 read: torch.Tensor, pool):
        device = pool.k.device
        self.mq = max(ns[j] for j in members)
        self.mk = max(spans[j][1] for j in members)
        # [layers, g, mk], padding -> the zero row; the step's own rows when it is one part
        whole = len(members) == read.shape[1]
        self.read = read[:, :, : self.mk] if whole else read[:, members, : self.mk].contiguous()
        # Batch rows of the members' tokens, sequence-major ([T_g]), and each one's row in the
        # padded [g * mq] query layout.
        self.tokens = torch.cat([torch.arange(starts[j], starts[j] + ns[j]) for j in members]).to(device)
        self.q_rows = torch.cat([torch.arange(i * self.mq, i * self.mq + ns[j])
                                 for i, j in enumerate(members)]).to(device)
        self.past = torch.tensor([spans[j][0] for j in members], device=device)[:, None, None]  # [g, 1, 1]
        self.total = torch.tensor([spans[j][1] for j in members], device=device)[:, None, None]
        self.dense = self.mq == 1  # decode only: no query padding
        self._masks: dict[int | None, torch.Tensor] = {}
        # Decodes in CPU half precision: a kernel of model/decode_attention.py (in bf16 a C kernel
        # reading the pool rows in place); key bounds [lo, hi) per member, by window.
        self.fused = self.dense and len(members) > 1 and decode_attention.applies(pool, device)
        self._bounds: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}

    def mask(self, window: int | None) -> torch.Tensor:
        """[g, 1, mq, mk] bool: query i of member j sees keys at positions <= past_j + i that exist.

        Padded query rows (i >= n_j) see every key of their sequence, so no row is all False."""
        if window not in self._masks:
            q_pos = self.past + torch.arange(self.mq, device=self.past.device)[None, :, None]  # [g, mq, 1]
            k_pos = torch.arange(self.mk, device=self.past.device)[None, None, :]  # [1, 1, mk]
            m = (k_pos <= q_pos) & (k_pos < self.total)
            if window is not None:
                m &= (q_pos - k_pos) < window
            self._masks[window] = m[:, None]
        return self._masks[window]

    def bounds(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each member's first and one-past-last visible key position ([g] each)."""
        if window not in self._bounds:
            hi = self.total.view(-1)
            self._bounds[window] = ((hi - window).clamp_(min=0) if window is not None else torch.zeros_like(hi), hi)
        return self._bounds[window]

    def attend(self, pool, i: int, q, scaling: float, window: int | None, sinks=None, expand=None) -> torch.Tensor:
        """Layer ``i``'s attention of the members' queries q [T_g, nH, D] -> [T_g, nH * Dv]."""
        read = self.read[i]  # [g, mk]
        if self.fused and sinks is None and expand is None:
            o = decode_attention.attend(q, pool, read, *self.bounds(window), scaling)
            if o is not None:
                return o
        g, nH, D = read.shape[0], q.shape[1], q.shape[2]
        keys, values = _expanded(decode_attention.gather_rows(pool.k, read).transpose(1, 2),
                                 decode_attention.gather_rows(pool.v, read).transpose(1, 2), expand)
        if self.dense:
            qp = q[:, :, None]  # [g, nH, 1, D]
        else:
            qp = q.new_zeros(g * self.mq, nH, D).index_copy_(0, self.q_rows, q)
            qp = qp.view(g, self.mq, nH, D).transpose(1, 2)  # [g, nH, mq, D]
        o = sdpa(qp, keys, values, self.mask(window), scaling, sinks)  # [g, nH, mq, Dv]
        Dv = o.shape[-1]
        if self.dense:
            return o.reshape(g, nH * Dv)
        return o.transpose(1, 2).reshape(g * self.mq, nH * Dv).index_select(0, self.q_rows)
