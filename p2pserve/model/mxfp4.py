"""MXFP4: the OCP microscaling 4-bit float format GPT-OSS's official checkpoints store experts in.

A weight row is cut into blocks of 32 values. Each value is an FP4 E2M1 code (1 sign bit, 2
exponent bits, 1 mantissa bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), two codes per byte, the
even element in the low nibble; each block shares one E8M0 scale, a biased power of two
(``2 ** (byte - 127)``). A checkpoint stores a projection ``P`` [E, R, C] of the module as
``P_blocks`` uint8 [E, R, C / 32, 16] and ``P_scales`` uint8 [E, R, C / 32], where the rows R are
the module's output features: the module holds the transpose ([E, C, R], ``x @ W``), as
transformers' GPT-OSS experts do.

Peers dequantize at load into the compute dtype (`dequantize_state`): every value of the format
is exact in bf16, fp16 and fp32, so the result is the stored weight itself. No MXFP4 matmul kernel
runs; memory is counted at the compute dtype. `quantize_mxfp4` is the other direction, used to
build MXFP4-stored test checkpoints.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values sharing one scale
_SCALE_BIAS = 127
# FP4 E2M1 magnitudes by code (codes 8-15 are the same, negative).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _code_values(dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(_E2M1 + tuple(-x for x in _E2M1), dtype=dtype)  # [16]


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``blocks`` uint8 [..., R, G, 16] and ``scales`` uint8 [..., R, G] -> the module's weight
    [..., G * 32, R] in ``dtype`` (the stored rows become columns)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} do not match scales "
                         f"{tuple(scales.shape)} {scales.dtype}")
    table = _code_values(torch.float32).to(blocks.device)
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]  # [..., R, G, 16] each
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., R, G, 32]: low nibble first
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - _SCALE_BIAS)  # exact: powers of two
    return values.flatten(-2).transpose(-1, -2).to(dtype).contiguous()  # [..., G * 32, R]


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's weight [..., C, R] (C a multiple of 32) -> (blocks, scales) as a checkpoint
    stores them. Each block's scale is the smallest power of two that brings its largest
    magnitude within 6, and each value rounds to the nearest E2M1 code (the lower magnitude on a
    tie)."""
    w = weight.transpose(-1, -2).to(torch.float32)  # [..., R, C]
    if w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs rows of a multiple of {BLOCK} values, got {w.shape[-1]}")
    w = w.reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)  # [..., R, G, 32]
    peak = w.abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)  # [..., R, G]
    exp = torch.ceil(torch.log2(peak / _E2M1[-1])).clamp(-_SCALE_BIAS, 127).to(torch.int32)
    scaled = torch.ldexp(w, -exp[..., None])  # within [-6, 6]
    magnitudes = torch.tensor(_E2M1)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # [..., R, G, 32]: 0..7
    codes = codes + 8 * (scaled < 0)
    pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], BLOCK // 2, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)  # [..., R, G, 16]
    return blocks.contiguous(), (exp + _SCALE_BIAS).to(torch.uint8)


def dequantize_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Replace every ``P_blocks`` / ``P_scales`` pair of a state dict by the dequantized ``P`` in
    ``dtype``; other tensors pass through. A blocks tensor without its scales is a `ValueError`."""
    if not any(name.endswith("_blocks") for name in state):
        return state
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            if base + "_scales" not in state:
                raise ValueError(f"MXFP4 tensor {name} has no {base}_scales")
            out[base] = dequantize_mxfp4(t, state[base + "_scales"], dtype)
        else:
            out[name] = t
    return out
