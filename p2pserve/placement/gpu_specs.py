"""Published GPU specs and single-GPU profiles derived from a measured one.

Helix's data measures LLaMA-2-70B per-layer latency on A100, V100, L4 and T4 only. HexGen's
clusters use RTX A6000, A5000, A4000, A40 and RTX 3090 Ti. For those we *derive* a profile
from the measured A100 (same Ampere generation) by a roofline ratio, point by point::

    t_X(n) = t_A100(n) * (W / bw_X + F(n) / c_X) / (W / bw_A100 + F(n) / c_A100)

with ``W`` one layer's weight bytes (the weight scan of a decode step), ``F(n) = 2 * (W / 2) *
n`` its matmul FLOPs for ``n`` tokens, ``bw`` the memory bandwidth and ``c`` the dense fp16
tensor throughput (fp32 accumulate, what PyTorch's fp16 matmul uses) from the vendors' spec
sheets. The measured shape (fixed overheads, batch steps) is kept; only the hardware ratio is
transferred. These are estimates, not measurements (docs/hexgen.md says so). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2pserve.errors import ConfigError
from p2pserve.placement.profile import LatencyProfile


@dataclass(frozen=True)
class GpuSpec:
    """A GPU type: memory, memory bandwidth (bytes/s), dense fp16 tensor FLOP/s."""

    name: str
    memory_bytes: float
    mem_bw: float
    flops: float


#: Spec-sheet figures (NVIDIA datasheets; GeForce: fp16 tensor with fp32 accumulate).
GPU_SPECS: dict[str, GpuSpec] = {
    s.name: s
    for s in (
        GpuSpec("A100", 40e9, 1555e9, 312e12),
        GpuSpec("A6000", 48e9, 768e9, 154.8e12),
        GpuSpec("A5000", 24e9, 768e9, 111.1e12),
        GpuSpec("A4000", 16e9, 448e9, 76.7e12),
        GpuSpec("A40", 48e9, 696e9, 149.7e12),
        GpuSpec("3090Ti", 24e9, 1008e9, 80e12),
    )
}


def gpu_spec(name: str) -> GpuSpec:
    """The spec of GPU type ``name`` (case-insensitive)."""
    for key, spec in GPU_SPECS.items():
        if key.lower() == name.lower():
            return spec
    raise ConfigError(f"no spec for GPU type {name!r}; known: {sorted(GPU_SPECS)}")


def derive_profile(ref: LatencyProfile, ref_spec: GpuSpec, spec: GpuSpec, layer_bytes: float) -> LatencyProfile:
    """``spec``'s per-layer profile from the measured ``ref`` of ``ref_spec`` (module docstring)."""

    def factor(n: float) -> float:
        flops = layer_bytes * n  # 2 FLOPs per fp16 weight (2 bytes) per token
        mine = layer_bytes / spec.mem_bw + flops / spec.flops
        theirs = layer_bytes / ref_spec.mem_bw + flops / ref_spec.flops
        return mine / theirs

    return LatencyProfile(
        ref.prompt_tokens, tuple(y * factor(x) for x, y in zip(ref.prompt_tokens, ref.prompt_ms_values)),
        ref.decode_tokens, tuple(y * factor(x) for x, y in zip(ref.decode_tokens, ref.decode_ms_values)),
    )
