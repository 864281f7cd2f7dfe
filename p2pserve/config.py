"""One frozen config dataclass per role. Defaults and their documentation live only here.

The control-plane and planner configs (``DHTConfig``, ``CoordinatorConfig``, ``PlannerConfig``)
are defined next to their code in ``p2pserve.dht`` and ``p2pserve.coordinator`` and re-exported
lazily below, so that importing this module stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2pserve.protocol import FrameLimits


@dataclass(frozen=True)
class BatchingConfig:
    """Per-step token budget after gLLM's token throttling (seed 002, §3).

    Prefill tokens per step: ``max(min(WP / throttle_steps, max_prefill * (kv_free - kv_threshold)
    / (1 - kv_threshold)), min_prefill)`` where WP is the number of waiting prefill tokens and
    kv_free the free share of the KV budget. Decode tokens per step: waiting decode tokens
    divided by ``pipeline_depth`` (spread evenly over the micro-batches in flight).
    """

    throttle_steps: int = 8  # gLLM's #T: spread waiting prefill over this many steps
    max_prefill_tokens: int = 2048  # #MaxP
    min_prefill_tokens: int = 32  # #MinP: never starve prefill entirely
    kv_threshold: float = 0.05  # KVthresh: below this free share, prefill gets #MinP only
    pipeline_depth: int = 1  # PP depth seen by this peer's decode spreading
    max_batch_tokens: int = 4096  # hard cap on tokens in one step, whatever the formula says
    # A decode from the only session active for this long runs on the I/O thread itself, skipping
    # two thread handoffs (~0.2 ms a hop); 0 disables it. Concurrent sessions always batch.
    inline_lone_decode_s: float = 0.05


@dataclass(frozen=True)
class PeerConfig:
    """Everything a peer process needs; built from CLI flags by ``p2pserve peer``."""

    model: str = "default"  # checkpoint directory, or "default" for the embedded SmolLM2
    start: int | None = None  # fixed layer range [start, end); None = plan-driven (or whole model)
    end: int | None = None
    device: str = "cpu"
    dtype: str = "float32"
    num_threads: int | None = None  # torch intra-op threads; tests use 1 (cores are shared)
    kv_budget_token_layers: int | None = None  # KV slots; None = derive from kv_memory_bytes
    kv_memory_bytes: int = 2 * 1024**3
    session_idle_timeout_s: float = 300.0
    max_sessions: int = 1024
    request_timeout_s: float = 120.0
    frame_limits: FrameLimits = field(default_factory=FrameLimits)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    # Plan-driven mode (no fixed range): how many layers this peer may hold, and how much
    # memory its weights may use; max_layers=None derives it from weights_memory_bytes.
    max_layers: int | None = None
    weights_memory_bytes: int = 8 * 1024**3
    profile_batch: int = 32  # concurrent sessions the announced decode throughput assumes
    announce: bool = False  # join the control plane: profile, probe links, announce, follow plans
    swarm_model: str | None = None  # model name in DHT keys; None = the checkpoint's model_id
    direct_port: int | None = 0  # TCP port of the direct path (0: any free one; None: libp2p only)
    probe_max_bytes: int = 64 * 1024**2  # largest link-probe transfer (caps the CPU a fast link's probe costs)


@dataclass(frozen=True)
class ClientConfig:
    """Client-side limits and timeouts."""

    hop_timeout_s: float = 60.0  # one Forward round trip, prefill included
    connect_timeout_s: float = 20.0
    frame_limits: FrameLimits = field(default_factory=FrameLimits)
    direct: bool = True  # use a peer's direct TCP path when it offers one and it is reachable
    direct_connect_timeout_s: float = 2.0
    max_retries: int = 3  # pipeline rebuilds per request before GenerationFailedError
    ban_base_s: float = 5.0  # first ban of a failed peer; doubles per repeat failure
    ban_max_s: float = 120.0
    stale_route_pause_s: float = 0.25  # after "range moved": let the peer's new announcement land


_ELSEWHERE = {
    "DHTConfig": "p2pserve.dht.config",
    "ProberConfig": "p2pserve.dht.prober",
    "CoordinatorConfig": "p2pserve.coordinator.service",
    "PlannerConfig": "p2pserve.placement.planner",
}


def __getattr__(name: str):
    """Lazy re-exports of the configs that live next to their (heavier) code."""
    if name in _ELSEWHERE:
        import importlib

        return getattr(importlib.import_module(_ELSEWHERE[name]), name)
    raise AttributeError(name)
