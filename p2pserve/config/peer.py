"""A peer's settings: :class:`PeerConfig` and the parts it holds (admission, batching, push
forwarding, tensor parallelism)."""

from __future__ import annotations

from dataclasses import dataclass, field

from p2pserve.config.dht import ProberConfig
from p2pserve.config.metrics import MetricsConfig
from p2pserve.protocol import FrameLimits


@dataclass(frozen=True)
class AdmissionConfig:
    """What remote participants may make a peer hold (``peer/admission.py``).

    An owner is the authenticated peer id behind a stream; the per-owner bounds keep one
    participant from taking every stream, session or KV slot of a volunteer's peer.
    """

    max_streams: int = 1024  # open session streams, all owners together
    max_streams_per_owner: int = 256  # a client node opens one stream per hop per request
    max_sessions_per_owner: int = 256
    max_kv_fraction_per_owner: float = 0.5  # of the KV budget; 1.0 turns the KV quota off
    prefix_sharing: str = "owner"  # KV prefix blocks shared within one owner's sessions, or "global" (peer/prefix_share.py)
    max_inflight_payload_bytes: int = 1024**3  # frame payloads being read or served, all streams
    stream_idle_timeout_s: float = 120.0  # a stream holding no session, silent this long, is closed
    frame_read_timeout_s: float = 30.0  # the rest of a frame once its first byte arrived ...
    min_read_rate_bytes_s: float = 1024**2  # ... plus its payload at this rate


#: The pipeline depth a peer holding only some layers assumes by default (``BatchingConfig.depth``).
STAGE_DEPTH = 2


@dataclass(frozen=True)
class BatchingConfig:
    """Per-step token budget after gLLM's token throttling (seed 002, §3).

    Prefill tokens per step: ``max(min(WP / spread_steps, max_prefill * (kv_free - kv_threshold)
    / (1 - kv_threshold)), min_prefill)`` where WP is the number of waiting prefill tokens and
    kv_free the free share of the KV budget. Decode tokens per step: waiting decode tokens
    divided by ``pipeline_depth`` (spread evenly over the micro-batches in flight).
    """

    # gLLM's #T: spread waiting prefill over this many steps; None: the pipeline depth. With d
    # micro-batches in flight, d steps give each its share of the prompts; at depth one a spread
    # only delays first tokens and splits a burst of sessions into groups that step apart
    # (docs/kv-cache.md, "Chunked prefill and token throttling").
    throttle_steps: int | None = None
    max_prefill_tokens: int = 2048  # #MaxP
    min_prefill_tokens: int = 32  # #MinP: never starve prefill entirely
    kv_threshold: float = 0.05  # KVthresh: below this free share, prefill gets #MinP only
    # gLLM's pipeline depth (micro-batches in flight) this peer's decode spreading assumes; None:
    # 1 on a peer holding every layer (it steps all its sessions at once), STAGE_DEPTH on a peer
    # that is one stage of several (``depth``; docs/engine.md, "Three peers")
    pipeline_depth: int | None = None
    max_batch_tokens: int = 4096  # hard cap on tokens in one step, whatever the formula says
    inline_lone_decode_s: float = 0.05  # a lone session's decode runs on the I/O thread after this long alone; 0: never
    background_max_skips: int = 64  # a witness replay (OpenSession.background) passed over this often runs anyway
    max_batch_wait_s: float = 0.0  # longest hold of a step for sessions due (peer/batch_forming.py); 0: off

    def depth(self, whole_model: bool) -> int:
        """The pipeline depth in effect on a peer that holds every layer (``whole_model``) or
        only some: ``pipeline_depth`` when set. A stage of a pipeline steps its sessions in
        ``STAGE_DEPTH`` micro-batches, so that while one group runs at the next stage the other
        runs here (three peers on two cores: 0.73x one peer at depth 2, 0.65x at depth 1)."""
        if self.pipeline_depth is not None:
            return max(1, self.pipeline_depth)
        return 1 if whole_model else STAGE_DEPTH

    def spread_steps(self, depth: int) -> int:
        """#T in effect at pipeline depth ``depth``: ``throttle_steps``, or the depth when that is None."""
        return self.throttle_steps if self.throttle_steps is not None else depth


@dataclass(frozen=True)
class ForwardingConfig:
    """Bounds on a peer's pushes to the next hop: dialling it, and the rest of the chain's ack,
    ``call_timeout_s`` per hop still to run (every later hop's compute and links); and how long
    the last hop holds an owner's ``AwaitResult`` for its step."""

    connect_timeout_s: float = 20.0
    call_timeout_s: float = 60.0
    wait_timeout_s: float = 300.0


@dataclass(frozen=True)
class TPConfig:
    """Tensor parallelism of one peer: one device per rank (``devices[0]`` is rank 0's)."""

    devices: tuple[str, ...] = ("cpu",)
    timeout_s: float = 60.0  # a collective (or a child's wait for the next message) longer than this fails
    ping_s: float = 2.0  # idle rank 0 pings this often
    num_threads: int | None = None  # torch threads per child

    @property
    def world(self) -> int:
        return len(self.devices)


#: A peer's link probes: transfers of ~0.25 s, long enough that TCP ramp-up and a shaper's burst
#: allowance are a small part of the measured time (a 20 Mbit/s link then reads within a few
#: percent). Each link is re-probed every link refresh, and announced as the best of its recent rounds.
PEER_PROBER = ProberConfig(target_transfer_s=0.25)


@dataclass(frozen=True)
class PeerConfig:
    """Everything a peer process needs; built from CLI flags by ``p2pserve peer``."""

    model: str = "default"  # checkpoint directory, or "default" for the embedded SmolLM2
    start: int | None = None  # fixed layer range [start, end); None = plan-driven (or whole model)
    end: int | None = None
    device: str = "cpu"
    dtype: str = "float32"
    quant: str | None = None  # weight-only int8 | nf4 | int4 of the decoder layers (model/quant.py)
    num_threads: int | None = None  # torch intra-op threads; tests use 1 (cores are shared)
    compile_buckets: tuple[int, ...] = ()  # batch buckets of the compiled layer parts, compiled at load; (): eager
    kv_budget_token_layers: int | None = None  # KV slots; None = derive from kv_memory_bytes
    kv_memory_bytes: int = 2 * 1024**3
    session_idle_timeout_s: float = 300.0
    max_sessions: int = 1024
    request_timeout_s: float = 120.0
    frame_limits: FrameLimits = field(default_factory=FrameLimits)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    max_layers: int | None = None  # plan-driven mode: the most layers to hold (None: from weights_memory_bytes)
    weights_memory_bytes: int = 8 * 1024**3
    profile_batch: int = 32  # concurrent sessions the announced decode throughput assumes
    announce: bool = False  # join the control plane: profile, probe links, announce, follow plans
    swarm_model: str | None = None  # model name in DHT keys; None = the checkpoint's model_id
    direct_port: int | None = 0  # TCP port of the direct path (0: any free one; None: libp2p only)
    # Hardening (docs/hardening.md): a step running longer than this withdraws the peer (announced as
    # draining) until the step ends; a dead compute thread is restarted at once.
    stuck_step_s: float = 60.0
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    forwarding: ForwardingConfig = field(default_factory=ForwardingConfig)  # push mode (peer/forwarding.py)
    tp: TPConfig | None = None  # this process is rank 0 of a tensor-parallel group (peer/tp_group.py)
    # Link probes (dht/prober.py), of an announcing peer. max_probe_bytes caps the CPU a fast link's
    # probe costs; min_interval_s is the swarm's link refresh, set where the swarm is known.
    prober: ProberConfig = field(default_factory=lambda: PEER_PROBER)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)  # the /metrics endpoint (port None: off)
