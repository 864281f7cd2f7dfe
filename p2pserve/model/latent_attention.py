"""Multi-head latent attention (DeepSeek-V3): its shape facts and its layer math over a latent cache.

An MLA layer does not cache keys and values. Each token's hidden state is projected to one
compressed latent ``c`` [r] (``kv_a_proj_with_mqa``, then ``kv_a_layernorm``; r = kv_lora_rank)
and one rotary key ``k_rot`` [R] shared by every head (R = qk_rope_head_dim); the keys' and
values' per-head parts are expanded from the latent at attention time
(``kv_b_proj``: c -> [nH, qk_nope_head_dim + v_head_dim]). The cache holds only ``c`` and
``k_rot``: r + R numbers per token and layer (512 + 64 in DeepSeek-V3) where full K and V would
hold nH × (qk_head_dim + v_head_dim) (128 × 320 = 40960).

The paged pool stores them as its K and V tensors of one "head": K rows [S, 1, r] hold the
latent, V rows [S, 1, R] the rotated shared key (`ModelSpec.kv_layout`). Attention gathers a
sequence's rows, expands them with the layer's own ``expand_kv`` (transformers 5.x caches
the same latent and expands the whole cache each step the same way, so a lone sequence runs the
very ops `generate` runs) and calls SDPA with per-head keys [nH, c, qk_head_dim] and values
[nH, c, v_head_dim].

Rope: DeepSeek lays its rotary dims out in interleaved pairs (``rope_interleave``, the default);
`rotate` reproduces transformers' interleaved rotation op for op, and the plain rotate-half
form otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: model_type of the families whose attention is MLA.
LATENT_FAMILIES = frozenset({"deepseek_v3"})


@dataclass(frozen=True)
class LatentShape:
    """An MLA layer's widths: ``q_lora_rank`` (0: a full-rank q_proj), the cached latent
    ``kv_lora_rank``, and each head's no-rope key part, rotary part and value width."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def attention_params(self, hidden: int, heads: int) -> int:
        """Weights of one MLA attention block (projections only; norms are negligible)."""
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = (hidden * self.q_lora_rank + self.q_lora_rank * heads * qk) if self.q_lora_rank else hidden * heads * qk
        kv = hidden * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * heads * (
            self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * hidden


def latent_shape(cfg: dict) -> LatentShape | None:
    """The MLA widths of a parsed config.json, or None when its attention is not latent."""
    if cfg.get("model_type") not in LATENT_FAMILIES:
        return None
    return LatentShape(int(cfg.get("q_lora_rank") or 0), int(cfg["kv_lora_rank"]), int(cfg["qk_nope_head_dim"]),
                       int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"]))


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, interleave: bool):
    """Rotary embedding of q [T, nH, R] and k [T, 1, R] with the shard's rows cos, sin_signed
    [T, 1, R] (sin with its first half negated): transformers' ``apply_rotary_pos_emb_interleave``
    (pairs (x0, x1), (x2, x3), ... each turned by one frequency) or ``apply_rotary_pos_emb``,
    elementwise the same ops (the layout of the operands does not change an elementwise result)."""
    half = cos.shape[-1] // 2
    if not interleave:
        sin = torch.cat((-sin_signed[..., :half], sin_signed[..., half:]), -1)
        return tuple(x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin for x in (q, k))
    c, s = cos[..., :half], -sin_signed[..., :half]  # cos and sin are cat(freqs, freqs)
    out = []
    for x in (q, k):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out.append(torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1))
    return tuple(out)


def latent_qkv(attn, h: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor):
    """One MLA layer's query and cache rows for normed hidden states h [T, H], as
    ``DeepseekV3Attention.forward`` computes them: q [T, nH, qk_head_dim] (rope applied to its
    last R dims), the latent [T, 1, r] and the rotated shared key [T, 1, R]."""
    T = h.shape[0]
    if attn.q_lora_rank is None:
        q = attn.q_proj(h)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(h)))
    q = q.view(T, -1, attn.qk_head_dim)
    q_pass, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    kv_nope, k_rot = torch.split(attn.kv_a_proj_with_mqa(h), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    kv_nope = attn.kv_a_layernorm(kv_nope).view(T, 1, attn.kv_lora_rank)
    q_rot, k_rot = rotate(q_rot, k_rot.view(T, 1, attn.qk_rope_head_dim), cos, sin_signed,
                          bool(getattr(attn.config, "rope_interleave", True)))
    return torch.cat((q_pass, q_rot), dim=-1), kv_nope, k_rot


def expander(attn):
    """The cache rows -> per-head keys and values of ``attn``: (latent [b, 1, c, r], rotated key
    [b, 1, c, R]) -> (keys [b, nH, c, qk_head_dim], values [b, nH, c, v_head_dim])."""

    def expand(latent: torch.Tensor, k_rot: torch.Tensor):
        return attn.expand_kv(latent.contiguous(), k_rot)

    return expand


def is_latent_attention(attn) -> bool:
    """True for an MLA attention module (it projects to a latent instead of k and v)."""
    return hasattr(attn, "kv_a_proj_with_mqa") and hasattr(attn, "expand_kv")
