"""Projection weights prepacked for oneDNN: the CPU half-precision matmul of the fast path.

On CPU, ``torch.mm`` over a bf16 weight reorders the weight into oneDNN's blocked layout on
every call. Reordering it once at load (``torch.ops.mkldnn._reorder_linear_weight``) and calling
oneDNN's linear on the packed weight skips that work: measured on a 2-core AVX-512-BF16 machine
(2 threads), a 576 -> 1536 projection of one row takes 31 us against 67, of 32 rows 171 us against
228, and SmolLM2's 49,152-row head 2.0 ms against 3.3 for one row (``benchmarks/step.py --ab``
measures the whole step with and without). The products are the same oneDNN kernel's, so they are
deterministic: one process and a swarm of peers that pack give the same bits.

Packing applies to bf16 weights on a CPU with native bf16 arithmetic (AVX-512-BF16 or AMX) and
torch built with oneDNN; fp32 keeps ``torch.mm`` (the exactness oracle is transformers' own fp32
kernel) and other devices keep their own kernels. A packed weight is a second copy: the layer
modules keep theirs for the module path.
"""

from __future__ import annotations

import torch


def packing_available() -> bool:
    """Whether this torch and CPU run oneDNN's packed bf16 linear natively."""
    cpu = getattr(torch, "cpu", None)
    native = cpu is not None and any(
        getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return (native and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def packs(weight: torch.Tensor) -> bool:
    """Whether ``weight`` ([out, in]) is one the fast path packs."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] reordered into oneDNN's layout (an opaque ``is_mkldnn`` tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2-D x [T, in] over a `pack`-ed weight -> [T, out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
