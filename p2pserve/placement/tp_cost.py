"""HexGen's cost model (ICML'24, Table 1 / Appendix B) for a tensor-parallel (TP) group.

A TP group of ``d`` GPUs is one logical node: every layer's weights are split ``1/d`` per GPU,
every GPU runs ``1/d`` of the layer's matrix multiplications, and each layer ends with two
all-reduces of the batch's hidden states (after attention and after the MLP). Per layer::

    t_d(n) = max_g t_g(n) / d  +  2 * allreduce(n * H * B_type)
    allreduce(m) = alpha + 2 (d - 1) / d * m / beta          (ring; 0 when d == 1)

``t_g(n)`` is the *measured* single-GPU time of one layer for a batch of ``n`` tokens (decode or
prompt; :class:`~p2pserve.placement.profile.LatencyProfile`), so HexGen's compute and weight-scan
terms (``12 H^2 B / m_d`` and ``24 b s H^2 / c_d``, both divided by ``d``) come from the profile
rather than from spec sheets; the max over the group's GPUs is HexGen's BSP rule (the slowest
GPU of a superstep sets its time). ``alpha`` is the per-collective latency and ``beta`` the
link's bus bandwidth (bytes/s), fitted per link kind to measured TP profiles
(:func:`fit_link`; the figures in :data:`PCIE3_FITTED` / :data:`PCIE4_FITTED` come from Helix's
T4 / T4x2 / T4x4 and L4 / L4x2 profiles, see docs/hexgen.md).

Memory per GPU (HexGen eq. 7, with KV in GQA form): ``k * layer_bytes / d`` weights plus its
share of the KV cache. :class:`GroupCost` turns all of this into the planner's view of a node:
a ``LatencyProfile``, ``max_layers``, KV capacity and the ``T[k]`` table (tokens/s holding
``k`` layers) in the format :class:`~p2pserve.placement.topology.NodeSpec` uses. Pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from p2pserve.errors import ConfigError
from p2pserve.placement.profile import LatencyProfile


@dataclass(frozen=True)
class LinkCost:
    """The alpha-beta cost of one collective over a group's slowest link.

    ``latency_s``: alpha, seconds per all-reduce (launch + synchronisation + wire latency).
    ``bus_bytes_per_s``: beta, the bandwidth one ring step moves data at.
    """

    bus_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if not (self.bus_bytes_per_s > 0 and math.isfinite(self.bus_bytes_per_s)):
            raise ConfigError(f"link bandwidth must be positive, not {self.bus_bytes_per_s!r}")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ConfigError(f"link latency must be >= 0, not {self.latency_s!r}")


#: Fitted to Helix's T4 -> T4x2 / T4x4 profiles (GCP n1 VMs, PCIe 3.0; docs/hexgen.md).
PCIE3_FITTED = LinkCost(bus_bytes_per_s=3.77e9, latency_s=164e-6)
#: Fitted to Helix's L4 -> L4x2 profiles (GCP g2 VMs, PCIe 4.0; docs/hexgen.md).
PCIE4_FITTED = LinkCost(bus_bytes_per_s=5.45e9, latency_s=96e-6)
#: NVLink 3 (A100 SXM class): 300 GB/s per direction in the spec sheet; NCCL bus bandwidth is
#: lower, ~230 GB/s. Not fitted here (no NVLink profile in the data); a spec-derived figure.
NVLINK3_SPEC = LinkCost(bus_bytes_per_s=230e9, latency_s=20e-6)


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs to know about the model.

    ``layer_bytes``: weights of one decoder layer. ``kv_bytes_per_token_layer``: K and V of one
    token in one layer (``2 * kv_heads * head_dim * dtype_bytes``). ``act_bytes``: one token's
    hidden state (``H * dtype_bytes``), the all-reduce's message per token.
    """

    name: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    dtype_bytes: int
    layer_bytes: float
    kv_bytes_per_token_layer: float

    @property
    def act_bytes(self) -> int:
        """Bytes of one token's hidden state."""
        return self.hidden * self.dtype_bytes

    def tp_ok(self, d: int) -> bool:
        """Whether a TP degree ``d`` splits the attention heads (and KV heads) evenly."""
        return d >= 1 and self.heads % d == 0 and self.kv_heads % d == 0


#: LLaMA-2-70B in fp16; layer size as in Helix's machine_params.json (1.53e9 bytes).
LLAMA2_70B = ModelShape("llama2-70b", 80, 8192, 64, 8, 2, 1.53e9, 2 * 8 * 128 * 2)


@dataclass(frozen=True)
class MemoryModel:
    """How a GPU's memory splits, fitted to Helix's machine_params.json (docs/hexgen.md).

    ``weight_fraction``: share of a GPU's memory the planner lets weights take (``max_layers``
    = floor(d * memory * fraction / layer_bytes); 0.46 reproduces Helix's max_num_layers of
    A100, L4, L4x2, T4, T4x2, one too many on T4x4). ``usable``: vLLM's
    gpu_memory_utilization. ``reserve_bytes``: per GPU, activations and CUDA context.
    """

    weight_fraction: float = 0.46
    usable: float = 0.9
    reserve_bytes: float = 3.7e9


def allreduce_s(message_bytes: float, d: int, link: LinkCost) -> float:
    """Seconds of one ring all-reduce of ``message_bytes`` over ``d`` GPUs (0 when d == 1)."""
    if d <= 1:
        return 0.0
    return link.latency_s + 2.0 * (d - 1) / d * message_bytes / link.bus_bytes_per_s


def tp_layer_ms(single_ms: float, tokens: float, d: int, link: LinkCost, act_bytes: int) -> float:
    """One layer at TP degree ``d``: the single-GPU time / d plus two all-reduces (ms)."""
    return single_ms / d + 2000.0 * allreduce_s(tokens * act_bytes, d, link)


def tp_profile(members: Sequence[LatencyProfile], link: LinkCost, act_bytes: int) -> LatencyProfile:
    """The per-layer profile of a TP group whose GPUs have the single-GPU profiles ``members``.

    Evaluated at the first member's measured token counts; BSP: the slowest member sets each
    point. One member returns its profile unchanged.
    """
    if not members:
        raise ConfigError("a TP group needs at least one GPU")
    d = len(members)
    if d == 1:
        return members[0]
    ref = members[0]

    def row(xs: tuple[float, ...], pick) -> tuple[float, ...]:
        return tuple(tp_layer_ms(max(pick(m, x) for m in members), x, d, link, act_bytes) if x > 0 else 0.0
                     for x in xs)

    return LatencyProfile(
        ref.prompt_tokens, row(ref.prompt_tokens, lambda m, x: m.prompt_ms(x)),
        ref.decode_tokens, row(ref.decode_tokens, lambda m, x: m.decode_ms(x)),
    )


def fit_link(single: LatencyProfile, grouped: Sequence[tuple[int, LatencyProfile]], act_bytes: int,
             max_tokens: float = 4000.0) -> tuple[LinkCost, float]:
    """Least-squares ``(alpha, beta)`` so that :func:`tp_layer_ms` of ``single`` matches the
    measured group profiles ``grouped`` (pairs ``(d, profile)``); also returns the mean relative
    error over the points used (prompt and decode, 0 < tokens <= ``max_tokens``).

    The overhead ``y = t_d(n) - t_1(n)/d`` is linear in ``x1 = 2`` and ``x2 = 4 (d-1)/d n act``:
    ``y = alpha x1 + x2 / beta``; solved by the 2x2 normal equations, each point weighted by
    ``1 / measured^2`` so that the fit minimises *relative* error (small decode batches, where
    alpha matters, count as much as long prompts).
    """
    rows: list[tuple[float, float, float, float]] = []  # (x1, x2, y, measured)
    for d, prof in grouped:
        for xs, f1, fd in ((prof.decode_tokens, single.decode_ms, prof.decode_ms),
                           (prof.prompt_tokens, single.prompt_ms, prof.prompt_ms)):
            for n in xs:
                if 0 < n <= max_tokens:
                    meas = fd(n) / 1000.0
                    rows.append((2.0, 4.0 * (d - 1) / d * n * act_bytes, meas - f1(n) / 1000.0 / d, meas))
    if len(rows) < 2:
        raise ConfigError("need at least two measured points to fit a link")
    w = [1.0 / (r[3] * r[3]) for r in rows]
    s11 = sum(wi * r[0] * r[0] for wi, r in zip(w, rows))
    s12 = sum(wi * r[0] * r[1] for wi, r in zip(w, rows))
    s22 = sum(wi * r[1] * r[1] for wi, r in zip(w, rows))
    t1 = sum(wi * r[0] * r[2] for wi, r in zip(w, rows))
    t2 = sum(wi * r[1] * r[2] for wi, r in zip(w, rows))
    det = s11 * s22 - s12 * s12
    alpha = max((t1 * s22 - t2 * s12) / det, 0.0)
    inv_beta = max((s11 * t2 - s12 * t1) / det, 1e-15)
    link = LinkCost(bus_bytes_per_s=1.0 / inv_beta, latency_s=alpha)
    err = 0.0
    for x1, x2, y, meas in rows:
        pred = meas - y + alpha * x1 + x2 * inv_beta
        err += abs(pred - meas) / meas
    return link, err / len(rows)


@dataclass(frozen=True)
class GroupCost:
    """The planner's view of one TP group: ``d`` GPUs of ``memory_bytes`` each (the smallest
    member's), per-layer ``profile`` from :func:`tp_profile`.

    ``decode_cap``: most decode tokens per batch (Helix's decode_max_tokens; 0 = none).
    ``avg_input`` / ``avg_output`` / ``reserved_output`` / ``kv_fill``: the workload the
    ``T[k]`` table assumes (defaults: Helix offline on Azure conversation, as
    :class:`~p2pserve.placement.estimate.WorkloadModel`).
    """

    d: int
    memory_bytes: float
    profile: LatencyProfile
    model: ModelShape = LLAMA2_70B
    memory: MemoryModel = MemoryModel()
    decode_cap: int = 480
    avg_input: float = 763.0
    avg_output: float = 232.0
    reserved_output: float = 240.0
    kv_fill: float = 0.85

    @property
    def max_layers(self) -> int:
        """Most layers the group holds (weights split 1/d per GPU, leaving KV room), capped at the
    model's."""
        k = int(self.d * self.memory_bytes * self.memory.weight_fraction // self.model.layer_bytes)
        k = min(k, self.model.num_layers)
        while k > 0 and self.kv_capacity(k) <= 0:  # weights must leave room for some KV
            k -= 1
        return k

    def kv_capacity(self, k: int) -> int:
        """Token-layer KV entries the group stores holding ``k`` layers (each GPU keeps 1/d of
        every entry, so the group's KV memory is the sum over its GPUs)."""
        m = self.memory
        free = self.d * (self.memory_bytes * m.usable - m.reserve_bytes) - k * self.model.layer_bytes
        return max(0, int(free // self.model.kv_bytes_per_token_layer))

    def decode_batch(self, k: int) -> int:
        """The decode batch the group runs holding ``k`` layers: requests its KV admits, capped."""
        per_request = self.avg_input + self.reserved_output
        n = int(self.kv_fill * self.kv_capacity(k) / k / per_request)
        if self.decode_cap:
            n = min(n, self.decode_cap)
        return max(n, 1)

    def throughput(self, k: int) -> float:
        """``T[k]``: tokens/s (prompt + decode) holding ``k`` layers, at the steady mix where a
        decode batch of ``B`` comes with ``B * input / output`` prompt tokens."""
        b = self.decode_batch(k)
        pt = b * self.avg_input / self.avg_output
        ms = k * (self.profile.prompt_ms(pt) + self.profile.decode_ms(b))
        return 1000.0 * (pt + b) / ms

    def table(self) -> tuple[float, ...]:
        """``T[0..max_layers]`` (index 0 is 0.0), the planner's node-throughput format."""
        return (0.0,) + tuple(self.throughput(k) for k in range(1, self.max_layers + 1))

    def kv_table(self) -> tuple[int, ...]:
        """KV capacity for ``0..max_layers`` layers (index 0 is 0)."""
        return (0,) + tuple(self.kv_capacity(k) for k in range(1, self.max_layers + 1))
