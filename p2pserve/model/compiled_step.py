"""A compiled layer for the shard's fast path: torch.compile over each layer's dense parts.

A decoder layer is two dense parts around attention: ``pre`` (input RMSNorm, q/k/v projections,
rotary) and ``post`` (o projection and residual, post-attention RMSNorm, gated MLP and residual).
Each part is one function compiled by ``torch.compile`` (inductor: C++ with vectorised fused
elementwise kernels on CPU, Triton on GPU) and called for every layer with that layer's weights
as arguments, so one compiled graph per batch bucket serves all layers. Attention between them
stays eager: it writes each sequence's keys and values into the paged pool and reads them back
(`model/attention.py`), which is data-dependent bookkeeping a static graph would have to copy.

Batch buckets: the rows of a step (one per decode sequence, or a prefill chunk's tokens) are
padded with zero rows up to the next bucket (``DEFAULT_BUCKETS``), and each part is compiled with
``dynamic=False``, so a bucket is compiled once, on its first step (or up front by ``warm``).
Padded rows stay finite (RMSNorm of zeros is zeros) and are dropped before attention. Steps
larger than the largest bucket run the eager path.

Exactness: inductor fuses and reorders the elementwise ops and may pick other GEMM kernels, so
compiled outputs are not bit-identical to the eager fast path; they are deterministic, so the
same compiled path gives the same bits in one process and in a swarm (the batch's row count is
the bucket's either way). benchmarks/step.py measures both and reports whether greedy tokens agree.
"""

from __future__ import annotations

import logging
import torch

from p2pserve.model.fast_ops import LayerPlan, Norm, gated_mlp, linear, qkv_of, rms_norm, rope

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)


def _detached(plan: LayerPlan) -> LayerPlan:
    """``plan`` with plain tensors for Parameters: compiled graphs take plain tensors as inputs,
    so every layer runs the same graph (Parameters would be guarded on, graph by graph)."""

    def lin(x):
        return None if x is None else (x[0].detach(), None if x[1] is None else x[1].detach())

    def norm(n: Norm | None):
        return None if n is None else Norm(n.weight.detach(), n.eps, n.eps_t, n.size_t)

    return LayerPlan(input_norm=norm(plan.input_norm), post_norm=norm(plan.post_norm), q_norm=norm(plan.q_norm),
                     k_norm=norm(plan.k_norm), q=lin(plan.q), k=lin(plan.k), v=lin(plan.v), o=lin(plan.o),
                     gate=lin(plan.gate), up=lin(plan.up), down=lin(plan.down), act=plan.act,
                     scaling=plan.scaling, qkv=lin(plan.qkv), gate_up=lin(plan.gate_up))


def _pre(x, p: LayerPlan, cos, sin, q_size: int, kv_size: int, head_dim: int):
    """x [Tb, H] -> q [Tb, nH, D], k and v [Tb, nKV, D], rotated; the eager fast path's ops."""
    h = rms_norm(x, p.input_norm)
    q, k, v = qkv_of(h, p, q_size, kv_size, head_dim)
    if p.q_norm is not None:
        q, k = rms_norm(q, p.q_norm), rms_norm(k, p.k_norm)
    q, k = rope(q, k, cos, sin)
    return q.contiguous(), k.contiguous(), v.contiguous()


def _post(x, o, p: LayerPlan):
    """x [Tb, H], attention output o [Tb, nH * D] -> the layer's output [Tb, H]."""
    x = linear(o, *p.o) + x
    return x + gated_mlp(rms_norm(x, p.post_norm), p)


class CompiledLayers:
    """``Shard._layer_fast`` with its dense parts compiled per batch bucket (module docstring)."""

    def __init__(self, shard, buckets: tuple[int, ...] = DEFAULT_BUCKETS, backend: str = "inductor"):
        plan = shard._fast_plan()
        if plan is None:
            raise ValueError("the compiled step needs the fast path (a known family, unquantized weights)")
        self.shard = shard
        self.buckets = tuple(sorted(buckets))
        self.plans = [_detached(p) for p in plan]
        spec = shard.spec
        self._sizes = (spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.head_dim)
        self._pre = torch.compile(_pre, dynamic=False, backend=backend)
        self._post = torch.compile(_post, dynamic=False, backend=backend)
        # One graph per bucket and part; more layers than the default limit share them.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4 * len(self.buckets))

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket holding ``rows``, or None (then the eager path runs)."""
        return next((b for b in self.buckets if b >= rows), None)

    def layer(self, layer_idx: int, x: torch.Tensor, cos, sin, segments) -> torch.Tensor:
        """One layer for x [T, H] (same contract as ``Shard._layer_fast``)."""
        T = x.shape[0]
        Tb = self.bucket(T)
        if Tb is None:
            return self.shard._layer_fast(layer_idx, x, cos, sin, segments)
        p = self.plans[layer_idx - self.shard.start]
        if Tb != T:
            x, cos, sin = _pad(x, Tb), _pad(cos, Tb), _pad(sin, Tb)
        q, k, v = self._pre(x, p, cos, sin, *self._sizes)
        o = self.shard._attention(layer_idx, q[:T], k[:T], v[:T], segments, p.scaling)  # [T, nH * D]
        if Tb != T:
            o = _pad(o, Tb)
        return self._post(x, o, p)[:T]

    @torch.inference_mode()
    def warm(self, dtype: torch.dtype) -> None:
        """Compile every bucket now (a peer does this once at start) on dummy inputs."""
        H, D = self.shard.spec.hidden_size, self.shard.spec.head_dim
        dev = self.shard.device
        p = self.plans[0]
        for b in self.buckets:
            x = torch.zeros(b, H, dtype=dtype, device=dev)
            cos = torch.ones(b, 1, D, dtype=dtype, device=dev)
            sin = torch.zeros(b, 1, D, dtype=dtype, device=dev)
            self._pre(x, p, cos, sin, *self._sizes)
            self._post(x, torch.zeros(b, self._sizes[0], dtype=dtype, device=dev), p)


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` rows."""
    return torch.cat((t, t.new_zeros(rows - t.shape[0], *t.shape[1:])))
