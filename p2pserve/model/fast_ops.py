"""The shard's fast path: the exact tensor ops transformers' layer modules run, called directly.

A decode step is one token per sequence, so with small models nearly all of its time is fixed
per-op cost (dispatch, ``nn.Module.__call__``), not arithmetic. ``build_layer_plans`` unwraps each
layer's tensors once (``LayerPlan``); the functions below run the same ops, in the same order,
as the modules (see ``shard.py``'s docstring for why each is bit-identical).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from p2pserve.model.experts import run_moe
from p2pserve.model.packed_linear import pack, packed_linear, packing_available, packs

log = logging.getLogger(__name__)

# Families whose decoder layer, attention, MLP and RMSNorm math `Shard._layer_fast` reproduces (checked
# against transformers 5.x): pre-norm, optional q/k/v biases (Qwen2), optional per-head q/k
# RMSNorm (Qwen3), gated MLP ``down(act(gate(x)) * up(x))``, attention sinks and biased experts
# (GPT-OSS). Latent attention (DeepSeek-V3) runs the module path.
FAST_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "qwen3_moe", "mixtral", "glm4_moe",
                           "gpt_oss"})


def linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2-D x: the exact kernel it dispatches to, without the
    ``linear -> matmul -> t`` wrappers (``weight_t`` is ``weight.t()``, made once), or oneDNN's
    linear over a weight packed at load (``weight_t.is_mkldnn``: model/packed_linear.py)."""
    if weight_t.is_mkldnn:
        return packed_linear(x, weight_t, bias)
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


class Norm(NamedTuple):
    """An RMSNorm's weight and eps, plus eps and the normalised size as 0-dim CPU tensors."""

    weight: torch.Tensor
    eps: float
    eps_t: torch.Tensor
    size_t: torch.Tensor


def norm_params(weight: torch.Tensor, eps: float) -> Norm:
    return Norm(weight, eps, torch.tensor(eps, dtype=torch.float32), torch.tensor(float(weight.shape[-1])))


def rms_norm(x: torch.Tensor, norm: Norm) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward``, op for op.

    On CPU, ``pow(2)`` is ``x * x`` and ``mean(-1)`` is ``sum(-1).div_(size)`` inside torch;
    they are spelled out here with ready 0-dim tensors for the divisor and eps, which skips
    wrapping Python scalars on every call and gives the same bits. Other devices run the
    transformers ops unchanged.
    """
    dtype = x.dtype
    h = x if dtype == torch.float32 else x.to(torch.float32)
    if h.is_cpu:
        variance = torch.sum(h * h, -1, keepdim=True).div_(norm.size_t).add_(norm.eps_t)
    else:
        variance = h.pow(2).mean(-1, keepdim=True) + norm.eps
    h = h * variance.rsqrt_()
    return (h if dtype == torch.float32 else h.to(dtype)).mul_(norm.weight)  # == weight * h


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor):
    """Rotary embedding of q [T, nH, D] and k [T, nKV, D] in one pass.

    transformers computes ``x * cos + rotate_half(x) * sin`` with rotate_half(x) = [-x2, x1].
    Here rotate_half(x) * sin = roll(x) * [-sin1, sin2] = [x2, x1] * sin_signed, which is the
    same product bit for bit ((-a) * b == a * (-b) in IEEE arithmetic); q and k are stacked so
    the four elementwise ops run once instead of twice.

    With partial rotary (GLM-4.5: cos, sin [T, 1, R] with R < D) only the first R dims of each
    head rotate and the other D - R pass through, concatenated after them as transformers does.
    """
    nq = q.shape[1]
    qk = torch.cat((q, k), 1)  # [T, nH + nKV, D]
    rotary = cos.shape[-1]
    if rotary < qk.shape[-1]:
        part, rest = qk[..., :rotary], qk[..., rotary:]
        qk = torch.cat((part * cos + torch.roll(part, rotary // 2, -1).mul_(sin_signed), rest), -1)
        q, k = qk[:, :nq], qk[:, nq:]
        return (q.contiguous() if q.shape[0] > 1 else q), k
    rotated = torch.roll(qk, qk.shape[-1] // 2, -1).mul_(sin_signed)
    qk = qk.mul_(cos).add_(rotated)  # == qk * cos + rotated
    q, k = qk[:, :nq], qk[:, nq:]
    if q.shape[0] > 1:  # give attention the same contiguous q as the unfused computation
        q = q.contiguous()
    return q, k


Linear = tuple[torch.Tensor, "torch.Tensor | None"]  # (weight.t(), bias) of one projection


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer's tensors, unwrapped from its modules for `Shard._layer_fast`.

    Linear weights are stored transposed (views) with their biases; ``act`` is None for
    SiLU (run in place), else the layer's own activation module. Phi-3 checkpoints fuse q/k/v
    into ``qkv`` and gate/up into ``gate_up`` (one matmul each, as its modules run them); then
    ``q``/``k``/``v`` and ``gate``/``up`` are None, and the other way round for every other family.
    A routed-experts layer (Qwen3-MoE, Mixtral) keeps its MoE block as ``moe``, called as a
    module (the router and the expert loop are transformers' own); its gate/up/down are None.
    """

    input_norm: Norm
    post_norm: Norm
    q_norm: Norm | None
    k_norm: Norm | None
    q: Linear | None
    k: Linear | None
    v: Linear | None
    o: Linear
    gate: Linear | None
    up: Linear | None
    down: Linear | None
    act: Callable[[torch.Tensor], torch.Tensor] | None
    scaling: float
    qkv: Linear | None = None
    gate_up: Linear | None = None
    moe: torch.nn.Module | None = None


class NoFastPath(Exception):
    """A layer the fast path does not recognise."""


def hf_silu_type():
    try:
        from transformers.activations import SiLUActivation
    except ImportError:
        return None
    return SiLUActivation


def _linear_of(m, pack_weights: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A plain ``nn.Linear``'s (weight.t() or its packed weight, bias) for `linear`."""
    if type(m) is not torch.nn.Linear or type(m.weight) not in (torch.Tensor, torch.nn.Parameter):
        raise NoFastPath  # e.g. a quantized weight (model/quant.py): only F.linear knows its kernel
    if pack_weights and packs(m.weight):
        return pack(m.weight), m.bias
    return m.weight.t(), m.bias


def build_layer_plans(shard, pack_weights: bool = True) -> tuple[tuple | None, list[LayerPlan] | None]:
    """Unwrap ``shard``'s head (final norm, LM head weight and bias) and every layer into a
    `LayerPlan`; ``(None, None)`` to use the module path. With ``pack_weights``, CPU bf16
    projections are packed for oneDNN where it runs them natively (model/packed_linear.py).

    Only layers built from the family's own classes with plain ``nn.Linear`` projections are
    unwrapped, so a transformers version that changes the layer layout falls back safely.
    """
    if shard.spec.family not in FAST_FAMILIES:
        return None, None
    norm_cls, attn_cls, mlp_cls, moe_cls = shard._fast_classes
    silu_types = tuple(t for t in (torch.nn.SiLU, hf_silu_type()) if t is not None)
    pack_weights = pack_weights and packing_available()

    def norm_of(m) -> Norm:
        if type(m) is not norm_cls:
            raise NoFastPath
        return norm_params(m.weight, float(m.variance_epsilon))

    def linear_of(m) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _linear_of(m, pack_weights)

    plans, head = [], None
    try:
        if shard.norm is not None:
            head = (norm_of(shard.norm), *linear_of(shard.lm_head))
        for layer in shard.layers:
            attn, mlp = layer.self_attn, layer.mlp
            # GPT-OSS names its routed block ``{Prefix}MLP``: a block with experts is routed.
            moe = type(mlp) in (moe_cls, mlp_cls) and hasattr(mlp, "experts")
            if type(attn) is not attn_cls or not (moe or type(mlp) is mlp_cls):
                raise NoFastPath
            has_qk_norm, fused = hasattr(attn, "q_norm"), hasattr(attn, "qkv_proj")  # Qwen3; Phi-3
            if fused != hasattr(mlp, "gate_up_proj"):
                raise NoFastPath
            act, dense = None if moe else mlp.activation_fn if fused else mlp.act_fn, not fused and not moe
            plans.append(
                LayerPlan(
                    input_norm=norm_of(layer.input_layernorm),
                    post_norm=norm_of(layer.post_attention_layernorm),
                    q_norm=norm_of(attn.q_norm) if has_qk_norm else None,
                    k_norm=norm_of(attn.k_norm) if has_qk_norm else None,
                    q=None if fused else linear_of(attn.q_proj),
                    k=None if fused else linear_of(attn.k_proj),
                    v=None if fused else linear_of(attn.v_proj),
                    o=linear_of(attn.o_proj),
                    gate=linear_of(mlp.gate_proj) if dense else None,
                    up=linear_of(mlp.up_proj) if dense else None,
                    down=None if moe else linear_of(mlp.down_proj),
                    act=None if isinstance(act, silu_types) else act,
                    scaling=attn.scaling,
                    qkv=linear_of(attn.qkv_proj) if fused else None,
                    gate_up=linear_of(mlp.gate_up_proj) if fused else None,
                    moe=mlp if moe else None,
                )
            )
    except (NoFastPath, AttributeError):
        log.info("shard of %s: layer layout not recognised, using the module path", shard.spec.family)
        return None, None
    return head, plans


def qkv_of(h: torch.Tensor, p: LayerPlan, q_size: int, kv_size: int, head_dim: int):
    """q [T, nH, D], k and v [T, nKV, D] of normed hidden states h [T, H]: three matmuls, or
    Phi-3's one fused matmul split into views, as its attention module slices it."""
    T = h.shape[0]
    if p.qkv is None:
        return (linear(h, *p.q).view(T, -1, head_dim), linear(h, *p.k).view(T, -1, head_dim),
                linear(h, *p.v).view(T, -1, head_dim))
    q, k, v = linear(h, *p.qkv).split((q_size, kv_size, kv_size), dim=-1)
    return q.view(T, -1, head_dim), k.view(T, -1, head_dim), v.view(T, -1, head_dim)


def gated_mlp(h: torch.Tensor, p: LayerPlan) -> torch.Tensor:
    """``down(act(gate(h)) * up(h))`` for h [T, H]; Phi-3's fused ``gate_up`` is chunked in two,
    and ``up * act(gate)`` is formed out of place as its MLP does (a * b == b * a bit for bit).
    A routed-experts block runs as its module, on one batch of T tokens."""
    if p.moe is not None:
        return run_moe(p.moe, h)
    if p.gate_up is not None:
        gate, up = linear(h, *p.gate_up).chunk(2, dim=-1)
        a = up * (F.silu(gate) if p.act is None else p.act(gate))
    elif p.act is None:  # SiLU, in place on the fresh gate output
        a = F.silu(linear(h, *p.gate), inplace=True).mul_(linear(h, *p.up))
    else:
        a = p.act(linear(h, *p.gate)) * linear(h, *p.up)
    return linear(a, *p.down)
