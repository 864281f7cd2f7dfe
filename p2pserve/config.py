"""One frozen config dataclass per role.

Defaults and their documentation live only here: ``PeerConfig`` (with ``BatchingConfig``),
``ClientConfig``, ``DHTConfig`` (every member's view of the swarm), ``ProberConfig`` (link
probes), ``CoordinatorConfig``, ``BootstrapConfig`` and ``DashboardConfig`` (the web view).
``PlannerConfig`` stays in ``p2pserve.placement.planner`` and ``MetricsConfig`` in
``p2pserve.metrics``, next to the code that reads them.

A command builds its role's config from the swarm file and its flags with
:func:`p2pserve.swarm_file.merge`; a value neither gives keeps the dataclass default here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from p2pserve.errors import ConfigError
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
    inline_lone_decode_s: float = 0.05  # a lone session's decode runs on the I/O thread after this long alone; 0: never
    background_max_skips: int = 64  # a witness replay (OpenSession.background) passed over this often runs anyway
    max_batch_wait_s: float = 0.0  # longest hold of a step for sessions due (peer/batch_forming.py); 0: off


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
    probe_max_bytes: int = 64 * 1024**2  # largest link-probe transfer (caps the CPU a fast link's probe costs)
    # Hardening (docs/hardening.md): a step running longer than this withdraws the peer (announced as
    # draining) until the step ends; a dead compute thread is restarted at once.
    stuck_step_s: float = 60.0
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)


@dataclass(frozen=True)
class ClientConfig:
    """Client-side limits and timeouts."""

    hop_timeout_s: float = 60.0  # one Forward round trip, prefill included
    connect_timeout_s: float = 20.0
    frame_limits: FrameLimits = field(default_factory=FrameLimits)
    direct: bool = True  # use a peer's direct TCP path when it offers one and it is reachable
    direct_connect_timeout_s: float = 2.0
    max_retries: int = 3  # pipeline rebuilds per request before GenerationFailedError
    ban_base_s: float = 5.0  # first ban of a failed peer; doubles per repeat failure (up to ban_max_s)
    ban_max_s: float = 120.0
    stale_route_pause_s: float = 0.25  # after "range moved": let the peer's new announcement land
    # No usable route (bans, a peer loading, a record not yet announced): wait up to this long in all,
    # re-reading the swarm, before failing (0: fail at once, HTTP 503; churn: tests/chaos).
    no_route_wait_s: float = 0.0
    # Output verification (client/verifier.py, docs/trust.md): the share of each hop's steps re-executed
    # on another replica in the background; 2% catches a peer corrupting 10% of its steps in tens of
    # requests (a check covers the whole session); 0: off. A caught peer's outputs are regenerated
    # (client/rollback.py); verify_hold makes a request await its own checks first, and
    # verify_every_request (with verify_share > 0) checks every hop of every route, never skipped.
    verify_share: float = 0.02
    verify_max_inflight: int = 4  # background checks at once; a draw beyond that is skipped
    verify_hold: bool = False
    verify_every_request: bool = False
    evidence_ttl_s: float = 3600.0  # how long this client's evidence record lives in the DHT
    # Observed service rates (client/observer.py): every report_period_s, a swarm client publishes
    # the per-session decode rates it measured at the peers it used (its last report_window
    # samples per peer) as a signed ServiceReports record; coordinators cap claims (trust.md). 0: off.
    report_period_s: float = 30.0
    report_window: int = 64
    push: object = None  # a client.push.PushConfig: when steps go peer to peer (None: never; docs/wan.md)

    def __post_init__(self) -> None:
        if not 0.0 <= self.verify_share <= 1.0:
            raise ConfigError(f"verify_share is a share of steps, in [0, 1], not {self.verify_share}")
        for name in ("hop_timeout_s", "connect_timeout_s", "direct_connect_timeout_s", "ban_base_s", "ban_max_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, not {getattr(self, name)}")
        for name in ("max_retries", "no_route_wait_s", "verify_max_inflight", "report_period_s", "report_window",
                     "stale_route_pause_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative, not {getattr(self, name)}")


@dataclass(frozen=True)
class ApiConfig:
    """The OpenAI-compatible HTTP server (``p2pserve api``): where it listens, who may use it, and
    the bounds that keep one client from holding its connections, memory or event loop."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()  # names requests may use besides the checkpoint id
    api_key: Optional[str] = field(default=None, repr=False)  # None: open to anyone who can connect
    allowed_hosts: tuple[str, ...] = ()  # keyless: Host names served besides IP literals and localhost
    header_timeout_s: float = 10.0  # from connect (or the last response) to a complete request head
    body_timeout_s: float = 30.0  # from the head to the end of the body (408, then close)
    keep_alive_s: float = 5.0  # an idle kept-alive connection is closed after this
    max_header_bytes: int = 16 * 1024  # request line + headers
    max_body_bytes: int = 4 * 1024**2  # 413, from Content-Length before reading and while reading
    max_inflight_body_bytes: int = 64 * 1024**2  # bodies being read, all together; past it 503
    max_connections: int = 256  # open connections; the next one gets 503 and is closed
    max_generations: int = 64  # generations in flight; the next request gets 429 with Retry-After
    max_prompt_chars: int = 200_000  # characters of prompt (or token ids), checked before tokenising
    shutdown_grace_s: float = 5.0  # running requests get this long to finish on shutdown

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("the API key is empty; give a non-empty key, or none for an open API")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s", "max_header_bytes", "max_body_bytes",
                     "max_inflight_body_bytes", "max_connections", "max_generations", "max_prompt_chars"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"ApiConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_inflight_body_bytes < self.max_body_bytes:
            raise ConfigError("ApiConfig.max_inflight_body_bytes must be >= max_body_bytes (one body must fit)")



# ============================================================================== control plane


def ttl_for(refresh_period: float, max_clock_skew: float) -> float:
    """Lifetime of a DHT record refreshed every ``refresh_period`` seconds.

    Two periods so that one late refresh does not make a live record vanish, and never less
    than the tolerated clock skew between nodes, since expirations are absolute DHT times.
    """
    return max(2.0 * refresh_period, max_clock_skew)


@dataclass(frozen=True)
class DHTConfig:
    """One node's view of one swarm + model: addresses, keys, trust, refresh periods.

    Refresh periods and the tolerated clock skew fix every record's TTL (:func:`ttl_for`);
    tests shrink them to fractions of a second.
    """

    model: str
    swarm_id: str = "p2pserve"
    # The model's layer count, when this node knows it: records are then checked against it
    # when read (a PeerInfo serving or able to hold more layers than the model has, a plan
    # for another depth, are rejected). None checks only the generic bounds.
    num_layers: Optional[int] = None
    initial_peers: tuple[str, ...] = ()
    # where the libp2p daemon listens / what it tells others; 0.0.0.0 for a real swarm
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    # The node's one RSA key: it signs the node's records and is its libp2p identity, so the peer
    # id follows from it. key_path holds it as DER, identity_path as a libp2p identity file;
    # give either (or both, holding the same key: p2pserve.dht.identity.node_key); neither =
    # a fresh key, and peer id, each start.
    identity_path: Optional[str] = None
    key_path: Optional[str] = None
    trusted_coordinators: tuple[str, ...] = ()  # OpenSSH public keys; empty = open swarm
    # Peer ids admitted as members: readers drop the peers/links/reports/evidence records of
    # anyone else (checked against the signer's key). Empty = an open swarm.
    allowed_peers: tuple[str, ...] = ()
    use_relay: bool = True  # may connect *through* relays (needed to reach NATed peers)
    use_auto_relay: bool = False  # look for a relay to become reachable when behind NAT
    client_mode: bool = False  # outgoing-only node (stores nothing for others)
    # refresh periods in seconds
    peer_refresh: float = 5.0
    link_refresh: float = 60.0
    candidate_refresh: float = 3.0
    plan_refresh: float = 10.0
    max_clock_skew: float = 2.0
    # lifetimes of the trust records (clients' service reports, verification evidence): a
    # writer's longer TTL is cut to these, a reader rejects expirations beyond them + skew
    report_ttl: float = 600.0
    evidence_ttl: float = 3600.0
    rpc_timeout: float = 10.0  # one DHT get/store
    reject_log_interval: float = 60.0  # the same rejected record is logged at most this often
    # a loaded peer keeps its old range at most this long for the peers taking its dropped
    # layers to load them (make-before-break, see p2pserve/peer/handover.py)
    handover_max_wait: float = 120.0

    def __post_init__(self) -> None:
        for name in ("peer_refresh", "link_refresh", "candidate_refresh", "plan_refresh", "rpc_timeout",
                     "report_ttl", "evidence_ttl"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"DHTConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_clock_skew < 0:
            raise ConfigError("DHTConfig.max_clock_skew must be >= 0")

    @property
    def peer_ttl(self) -> float:
        """Lifetime of a PeerInfo record."""
        return ttl_for(self.peer_refresh, self.max_clock_skew)

    @property
    def link_ttl(self) -> float:
        """Lifetime of a LinkInfo record."""
        return ttl_for(self.link_refresh, self.max_clock_skew)

    @property
    def candidate_ttl(self) -> float:
        """Lifetime of a CoordinatorCandidate record: bounds how long a dead leader stays elected."""
        return ttl_for(self.candidate_refresh, self.max_clock_skew)

    @property
    def plan_ttl(self) -> float:
        """Lifetime of a Plan record (readers also keep the last plan they saw)."""
        return ttl_for(self.plan_refresh, self.max_clock_skew)

    def ttl(self, kind: str) -> float:
        """Lifetime of a record of ``kind`` (a ``RecordKind`` or its value): the most a reader accepts, beyond its skew."""
        return {"peers": self.peer_ttl, "links": self.link_ttl, "coordinators": self.candidate_ttl,
                "plan": self.plan_ttl, "reports": self.report_ttl, "evidence": self.evidence_ttl, "machines": self.peer_ttl}[kind]

    def replace(self, **changes) -> "DHTConfig":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ProberConfig:
    """Sizes, targets and limits of link probing (``p2pserve.dht.prober``)."""

    min_probe_bytes: int = 64 << 10
    max_probe_bytes: int = 64 << 20
    target_transfer_s: float = 0.1
    pings: int = 3
    repeats: int = 3  # transfers at the final size; the fastest counts (disturbances only slow a transfer)
    min_interval_s: float = 60.0  # per target
    server_bytes_per_s: float = 200e6  # average probe bytes accepted per second
    server_burst_bytes: int = 160 << 20
    # One prober's share of the budget above: a single remote peer cannot spend all of it, so
    # the others' probes still get through.
    per_prober_share: float = 0.25
    max_concurrent: int = 1
    timeout_s: float = 10.0
    keep_rounds: int = 3  # a link reads as the best of its last rounds (a busy host only under-reads)


@dataclass(frozen=True)
class CoordinatorConfig:
    """Planning parameters of one coordinator (``p2pserve.coordinator``)."""

    num_layers: int
    activation_bytes: int = 8192  # bytes per token of hidden state (hidden_size x dtype bytes)
    token_bytes: int = 4  # bytes per token id on source/sink edges
    priority: int = 0  # election: higher wins
    coordinator_id: str = ""  # default: this node's libp2p peer id
    tick: Optional[float] = None  # loop period; default: the DHT candidate refresh period
    replan_period: float = 60.0  # re-plan at least this often even if nothing changed
    link_change_threshold: float = 0.3  # relative bandwidth change that triggers a re-plan
    default_bandwidth: float = 1.25e6  # bytes/s assumed for an unmeasured link (10 Mbit/s)
    default_rtt: float = 0.1  # seconds assumed for an unmeasured link
    client_bandwidth: float = 12.5e6  # bytes/s of source/sink edges (clients are not probed)
    objective: str = "throughput"  # planner objective: "throughput" (decode estimate) or "max-flow"
    grouping: str = "auto"  # machine agents' groupings: "auto" or a TP degree (checked by coordinator/groupings.py)
    solve_time_limit: float = 5.0  # wall-clock budget of one placement solve (s)
    reload_cost_per_layer: Optional[float] = None  # in the objective's units; None: from reload_share
    # Moving a whole model's worth of layers must gain this share of the objective. Peers flip
    # to new ranges one by one as they finish loading, so every move risks a window with less
    # coverage: move only for a real gain (measured links that undo a cross-region placement
    # gain ~40%; small re-shuffles after a join do not pay).
    reload_share: float = 0.25
    # Churn re-solves may give up this share of the best objective they found to load fewer
    # layers (``churn.fewest_moves_within``); 0 keeps the reload price alone.
    churn_tolerance: float = 0.0
    seed: int = 0
    # a new candidate only observes for this long before it may lead, so that it has seen every
    # live candidacy (default: one candidate TTL); avoids two leaders right after a start
    election_grace: Optional[float] = None
    # Verification (docs/trust.md): a trusted verifier's case (its DHT key or peer id) excludes a peer for exclusion_s;
    # anyone else's is an accusation the leader re-executes on retrial_replicas replicas (coordinator/retrial.py).
    trusted_verifiers: tuple[str, ...] = ()
    trust_verifiers: bool = True
    retrial_replicas: int = 2
    exclusion_s: float = 3600.0
    # Claims (coordinator/claims.py, docs/trust.md "Claims"): a peer's throughput table is scaled
    # down to min(claim, claim_slack x observed), where observed is the median over independent
    # reporters (one per address, each with >= min_report_samples decode samples) of the
    # per-session rate clients saw, times claim_batch (the batch a claim is profiled at,
    # PeerConfig.profile_batch). A reporter's RTT correction may raise its rate at most
    # max_rtt_credit-fold above the wall-clock rate. A peer nobody observed is capped at
    # unobserved_share x the median one-layer effective rate of observed peers, and the unobserved
    # peers together at unobserved_total_share x the observed peers' total. While nobody is
    # observed (a cold swarm), claims are capped at cold_claim_slack x the median claim.
    check_claims: bool = True
    claim_slack: float = 2.0
    claim_batch: int = 32
    min_report_samples: int = 8
    min_reporter_addresses: int = 2  # a peer is "observed" only by this many independent addresses
    max_rtt_credit: float = 4.0
    unobserved_share: float = 1.0
    unobserved_total_share: float = 0.25
    cold_claim_slack: float = 8.0
    # Open swarms: at most this many peers per IP (of their announced addresses) get layers and
    # flow; the rest are left out with a logged reason. 0: no cap. Addresses are self-announced.
    max_peers_per_address: int = 0

    def __post_init__(self) -> None:
        if self.claim_slack <= 0 or self.claim_batch < 1 or self.min_report_samples < 1:
            raise ConfigError("claim_slack must be > 0, claim_batch and min_report_samples >= 1")
        if self.unobserved_total_share <= 0 or self.cold_claim_slack < 1 or self.min_reporter_addresses < 1:
            raise ConfigError("unobserved_total_share must be > 0, cold_claim_slack and min_reporter_addresses >= 1")
        if self.max_rtt_credit < 1 or self.unobserved_share <= 0 or self.max_peers_per_address < 0:
            raise ConfigError("max_rtt_credit must be >= 1, unobserved_share > 0, max_peers_per_address >= 0")
        if self.num_layers < 1:
            raise ConfigError("CoordinatorConfig.num_layers must be >= 1")
        if self.activation_bytes < 1 or self.token_bytes < 1:
            raise ConfigError("activation_bytes and token_bytes must be >= 1")
        if not 0 <= self.churn_tolerance < 1:
            raise ConfigError("churn_tolerance must be in [0, 1)")
        if not 0 < self.link_change_threshold:
            raise ConfigError("link_change_threshold must be > 0")


@dataclass(frozen=True)
class BootstrapConfig:
    """A long-lived DHT node that holds no model (``p2pserve bootstrap``)."""

    initial_peers: tuple[str, ...] = ()  # other bootstrap nodes to join
    # a fixed port (with a persistent identity) keeps the multiaddr, and so everyone's config, stable
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/31337",)
    announce_maddrs: tuple[str, ...] = ()
    identity_path: Optional[str] = None
    use_relay: bool = True
    maddrs_file: Optional[str] = None  # also write the multiaddrs here (scripts, tests)


@dataclass(frozen=True)
class DashboardConfig:
    """The web dashboard (``p2pserve status --web``, ``coordinator --web-port``, ``api
    --dashboard``; ``docs/dashboard.md``): where it listens and how much it remembers. Its HTTP
    connections are bounded like the API's (``ApiConfig``'s header/body timeouts and connection
    cap, through the same guarded protocol)."""

    host: str = "127.0.0.1"  # the page shows the whole swarm and this process's routes: local by default
    port: int = 8787
    refresh_s: float = 2.0  # one DHT read per refresh, however many browsers poll /api/swarm
    history_samples: int = 300  # tokens/s samples kept (10 minutes at the default refresh)
    history_peers: int = 16  # peers whose observed rate is charted (the fastest)
    recent_requests: int = 50  # requests listed with their routes (api only)
    max_links: int = 4096  # links listed, between live peers

    def __post_init__(self) -> None:
        if not self.refresh_s > 0:
            raise ConfigError(f"DashboardConfig.refresh_s must be > 0, got {self.refresh_s!r}")
        for name in ("history_samples", "history_peers", "recent_requests", "max_links"):
            if getattr(self, name) < 1:
                raise ConfigError(f"DashboardConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"DashboardConfig.port must be in [0, 65535], got {self.port}")
