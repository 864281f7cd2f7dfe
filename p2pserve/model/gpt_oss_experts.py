"""GPT-OSS's experts as one ``nn.Linear`` per expert and projection, for weight-only quantization.

transformers holds a GPT-OSS layer's experts as transposed fused parameters with biases:
``gate_up_proj`` [E, H, 2I] (gate and up interleaved: gate in the even columns, up in the odd),
``gate_up_proj_bias`` [E, 2I], ``down_proj`` [E, I, H], ``down_proj_bias`` [E, H], and runs
``x @ W + b``. Its activation is a clamped SwiGLU: ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)``
with ``g = min(gate, limit)``. `BiasedLinearExperts` keeps that math on ``nn.Linear`` modules (weights
[2I, H] and [H, I], the transposes), which torchao and bitsandbytes quantize like any projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def is_biased_experts(module: torch.nn.Module) -> bool:
    """True for transformers' GPT-OSS experts module (transposed 3-D weights with biases)."""
    w = getattr(module, "gate_up_proj", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 3 and getattr(module, "has_bias", False)
            and isinstance(getattr(module, "gate_up_proj_bias", None), torch.Tensor) and hasattr(module, "limit"))


def _linear(weight: torch.Tensor, bias: torch.Tensor) -> torch.nn.Linear:
    """An ``nn.Linear`` holding ``weight`` [out, in] and ``bias`` [out] (copies)."""
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], device="meta")
    lin.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)
    lin.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
    return lin


class BiasedLinearExperts(torch.nn.Module):
    """GPT-OSS's experts module as per-expert ``nn.Linear``s. Called as the fused module is:
    (hidden [T, H], router_indices [T, k], routing_weights [T, k]) -> [T, H]."""

    def __init__(self, fused: torch.nn.Module):
        super().__init__()
        self.num_experts = fused.gate_up_proj.shape[0]
        self.alpha, self.limit = float(fused.alpha), float(fused.limit)
        self.gate_up = torch.nn.ModuleList(_linear(fused.gate_up_proj[e].t(), fused.gate_up_proj_bias[e])
                                           for e in range(self.num_experts))
        self.down = torch.nn.ModuleList(_linear(fused.down_proj[e].t(), fused.down_proj_bias[e])
                                        for e in range(self.num_experts))

    def _gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The clamped SwiGLU of interleaved gate/up columns: [n, 2I] -> [n, I]."""
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor, routing_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)  # [T, H]
        with torch.no_grad():
            mask = F.one_hot(router_indices, num_classes=self.num_experts).permute(2, 1, 0)  # [E, k, T]
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            top_k_pos, token_idx = torch.where(mask[e])
            y = self.down[e](self._gated(self.gate_up[e](hidden_states[token_idx])))  # [n, H]
            out.index_add_(0, token_idx, (y * routing_weights[token_idx, top_k_pos, None]).to(out.dtype))
        return out
