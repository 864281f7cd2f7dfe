"""Mixture-of-experts layers: their shape facts, their checkpoint layout, and their quantizable form.

A routed-experts layer replaces the dense MLP by E expert MLPs and a router that sends each token
to k of them. transformers 5.x holds the experts of one layer as two fused 3-D parameters,
``experts.gate_up_proj`` [E, 2I, H] (each expert's gate rows, then its up rows) and
``experts.down_proj`` [E, H, I], while the hub's checkpoints store one 2-D matrix per expert
(Qwen3-MoE: ``mlp.experts.{e}.gate_proj.weight``; Mixtral: ``block_sparse_moe.experts.{e}.w1``
(gate), ``w3`` (up), ``w2`` (down)). `fuse_layer_tensors` turns one layer's checkpoint tensors
into the module's names, as transformers' own loader does (its conversion mapping: stack the
experts, concatenate gate and up); a checkpoint that already stores the fused form passes through.

Memory and compute differ for these layers: all E experts' weights sit in memory, but a token
runs only k of them (``ModelSpec.layer_param_count`` against ``layer_active_param_count``).

Weight-only quantization (``model/quant.py``) works on ``nn.Linear``; `unfuse_experts` turns each
fused experts module into `LinearExperts`, one ``nn.Linear`` per expert and projection, running
the very loop transformers' eager experts forward runs, so torchao and bitsandbytes quantize the
experts like any other projection.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from p2pserve.errors import BadRequestError
from p2pserve.model.gpt_oss_experts import BiasedLinearExperts, is_biased_experts

# family -> (checkpoint prefix of the MoE block inside a layer, expert projection names
# (gate, up, down) in the checkpoint)
_CHECKPOINT_LAYOUT: dict[str, tuple[str, tuple[str, str, str]]] = {
    "qwen3_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe.", ("w1", "w3", "w2")),
    "glm4_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v3": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
}
# GPT-OSS checkpoints store the experts already fused (or as MXFP4 blocks of the fused form,
# model/mxfp4.py), so they need no layout entry.
MOE_FAMILIES = frozenset(_CHECKPOINT_LAYOUT) | {"gpt_oss"}


@dataclass(frozen=True)
class ExpertShape:
    """How many experts a layer holds, how many a token runs, and each expert's MLP width;
    ``moe_layers`` is how many of the model's layers are routed (the rest are dense), and
    ``shared_intermediate_size`` the width of the shared experts every token runs besides its
    routed ones (GLM-4.5; 0 where there are none)."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    moe_layers: int
    shared_intermediate_size: int = 0


def expert_shape(cfg: dict, num_layers: int) -> ExpertShape | None:
    """The experts of a parsed config.json, or None for a dense model."""
    family = cfg.get("model_type")
    if family == "mixtral":
        return ExpertShape(int(cfg.get("num_local_experts", 8)), int(cfg.get("num_experts_per_tok", 2)),
                           int(cfg["intermediate_size"]), num_layers)
    if family == "qwen3_moe":
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        moe = sum(1 for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        return ExpertShape(int(cfg["num_experts"]), int(cfg["num_experts_per_tok"]),
                           int(cfg["moe_intermediate_size"]), moe)
    if family == "gpt_oss":  # every layer routed; experts have biases and a router bias
        return ExpertShape(int(cfg.get("num_local_experts", 32)), int(cfg.get("num_experts_per_tok", 4)),
                           int(cfg["intermediate_size"]), num_layers)
    if family in ("glm4_moe", "deepseek_v3"):  # the first first_k_dense_replace layers are dense
        width = int(cfg.get("moe_intermediate_size", 1408))
        return ExpertShape(int(cfg.get("n_routed_experts", 128)), int(cfg.get("num_experts_per_tok", 8)), width,
                           max(0, num_layers - int(cfg.get("first_k_dense_replace", 1))),
                           width * int(cfg.get("n_shared_experts", 1)))
    return None


def fuse_layer_tensors(family: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One layer's checkpoint tensors (names relative to the layer, e.g. ``mlp.experts.3.up_proj.weight``)
    under the names transformers' module holds: per-expert matrices stacked into ``mlp.experts.gate_up_proj``
    [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I], the router as ``mlp.gate.weight``. Tensors of
    dense families, and already fused ones, come back unchanged; a layer whose experts are not
    numbered 0..E-1 in all three projections is a `BadRequestError`."""
    layout = _CHECKPOINT_LAYOUT.get(family)
    if layout is None:
        return tensors
    block, (gate, up, down) = layout
    pattern = re.compile(rf"^{re.escape(block)}experts\.(\d+)\.(\w+)\.weight$")
    per_expert: dict[str, dict[int, torch.Tensor]] = {gate: {}, up: {}, down: {}}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = pattern.match(name)
        if m and m.group(2) in per_expert:
            per_expert[m.group(2)][int(m.group(1))] = t
        elif name.startswith(block):
            out["mlp." + name[len(block):]] = t
        else:
            out[name] = t
    if per_expert[gate]:
        experts = sorted(per_expert[gate])
        if experts != list(range(len(experts))) or any(sorted(per_expert[p]) != experts for p in (up, down)):
            raise BadRequestError(f"{family} checkpoint layer holds an incomplete set of experts: "
                                  f"{[sorted(per_expert[p]) for p in (gate, up, down)]}")
        out["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat((per_expert[gate][e], per_expert[up][e])) for e in experts])  # [E, 2I, H]
        out["mlp.experts.down_proj"] = torch.stack([per_expert[down][e] for e in experts])  # [E, H, I]
    return out


def is_fused_experts(module: torch.nn.Module) -> bool:
    """True for transformers' fused experts module (3-D ``gate_up_proj`` and ``down_proj``)."""
    w = getattr(module, "gate_up_proj", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 3 and isinstance(getattr(module, "down_proj", None), torch.Tensor)
            and hasattr(module, "act_fn") and not getattr(module, "has_bias", False))


class LinearExperts(torch.nn.Module):
    """A fused experts module as one ``nn.Linear`` per expert (``gate_up[e]`` [2I, H], ``down[e]``
    [H, I]): transformers' eager experts loop, op for op, on modules a weight-only quantizer
    replaces. Called as the fused module is: (hidden [T, H], top_k_index [T, k], top_k_weights
    [T, k]) -> [T, H]."""

    def __init__(self, fused: torch.nn.Module):
        super().__init__()
        E, two_i, H = fused.gate_up_proj.shape
        self.num_experts = E
        self.act_fn = fused.act_fn

        def linear_of(w: torch.Tensor) -> torch.nn.Linear:
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            lin.weight = torch.nn.Parameter(w.detach().clone(), requires_grad=False)
            return lin

        self.gate_up = torch.nn.ModuleList(linear_of(fused.gate_up_proj[e]) for e in range(E))
        self.down = torch.nn.ModuleList(linear_of(fused.down_proj[e]) for e in range(E))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)  # [T, H]
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)  # [E+1, k, T]
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            if e == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[e])
            gate, up = self.gate_up[e](hidden_states[token_idx]).chunk(2, dim=-1)  # [n, I] each
            y = self.down[e](self.act_fn(gate) * up) * top_k_weights[token_idx, top_k_pos, None]  # [n, H]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


def unfuse_experts(layers: torch.nn.Module) -> int:
    """Replace, in place, every fused experts module inside ``layers`` by `LinearExperts` (GPT-OSS's
    biased ones by `BiasedLinearExperts`); returns how many were replaced."""
    count = 0
    for parent in list(layers.modules()):
        for name, child in list(parent.named_children()):
            if is_fused_experts(child) or is_biased_experts(child):
                setattr(parent, name, (LinearExperts if is_fused_experts(child) else BiasedLinearExperts)(child))
                count += 1
    return count


def mlp_of(mlp: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """A layer's MLP on h [T, H]: dense MLPs take it as it is; transformers' routed-experts blocks
    read a [B, S, H] input, so they get one batch of T tokens (routing is per token either way)."""
    if hasattr(mlp, "experts"):
        return run_moe(mlp, h)
    return mlp(h)


def run_moe(block: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """A routed-experts block on h [T, H] as one batch of T tokens -> [T, H]; GPT-OSS's block also
    returns its router scores, which serving drops."""
    out = block(h[None])
    return (out[0] if isinstance(out, tuple) else out)[0]
