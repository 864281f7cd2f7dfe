"""A client's settings: :class:`ClientConfig`, when it pushes (:class:`PushConfig`) and how it
drafts (:class:`SpeculativeConfig`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from p2pserve.config.dht import DHTConfig
from p2pserve.errors import ConfigError
from p2pserve.protocol import MAX_PUSH_HOPS, MAX_RING_AHEAD, MAX_VERIFY_OUTPUTS, FrameLimits


#: ``--push`` of ``p2pserve chat`` / ``api``: ring (every route of two or more hops runs as a
#: ring: ``client/ring.py``), off (they are client-driven). A route of one hop loops on its peer
#: whatever the mode (``--no-loop``). A chain push (``PushConfig(enabled=True)``) is no mode of
#: the commands: a ring was faster wherever it was measured (docs/wan.md, "Push and ring,
#: measured"); it carries a ring route's speculative steps.
PUSH_MODES = ("ring", "off")


@dataclass(frozen=True)
class PushConfig:
    """When a pipeline pushes its steps peer to peer instead of driving every hop.

    ``PushConfig()`` keeps client-driven hops on routes of two or more hops (``--push off``);
    ``ClientConfig`` runs them as rings by default (``from_mode("ring")``). A chain push (the
    last hop returns the token) is not measured to win on every link (docs/wan.md, "Push mode"),
    and every push needs peers that can find each other in the swarm's records. With
    ``enabled``, a route is pushed when it has at least ``min_hops`` hops and the median round
    trip the client measured opening its sessions (no compute behind it: the link) is at least
    ``min_rtt_ms``, unless outputs are verified (the verifier re-executes each hop's recorded
    exchange, which a chain push does not show the client).

    ``ring``: a pushed route runs as a ring (``client/ring.py``: the last hop pushes each next
    token to the first itself) for its one-token steps; speculative verification steps, and
    generations with a drafter, stay plain pushes. A ring needs no round trip of the client per
    token, so the round-trip rule does not apply to it: every route of at least two hops runs one.

    ``loop`` (on by default, whatever ``enabled`` says): a route of one hop, a peer holding
    every layer, runs its one-token steps as a ring on that peer alone, which samples each token
    and runs the next step itself (``peer/forwarding.py``); its sessions then step together in
    the peer's batches instead of one client round trip apart. Verified routes loop too: the
    client still gets every input and signed output of the hop, so its checks are drawn as
    ever, and the peer sees the same messages from a checked session as from any other. ``window``: how many steps a
    ring may run past the token the client asked for (its tokens wait at the last hop, and a
    stop string the client finds costs up to that many steps of compute).
    """

    enabled: bool = False
    min_hops: int = 2
    min_rtt_ms: float = 10.0  # the rule and the measurements behind it: docs/wan.md, "Push mode"
    ring: bool = False
    loop: bool = True
    window: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.window <= MAX_RING_AHEAD:
            raise ConfigError(f"a ring's window must be between 1 and {MAX_RING_AHEAD}, not {self.window}")

    @classmethod
    def from_mode(cls, mode: str) -> "PushConfig":
        """The config of a ``--push`` mode (``PUSH_MODES``)."""
        if mode not in PUSH_MODES:
            raise ConfigError(f"--push must be one of {', '.join(PUSH_MODES)}, not {mode!r}")
        return cls(enabled=mode == "ring", ring=mode == "ring")

    def use_push(self, hops: int, verified: bool, rtts_s: Sequence[float | None] = ()) -> bool:
        """Whether a route of ``hops`` hops, whose sessions opened in ``rtts_s`` seconds (None:
        not measured, counted as 0), is pushed."""
        # at least 2 hops whatever min_hops says: a lone hop would get its AwaitResult and its
        # PushForward on one stream, and its handler serves them in order
        if hops == 1:  # the loop shows the client all its one hop consumed and returned: verified or not
            return self.loop
        if self.enabled and self.ring:  # a ring shows the client every hop's exchange: verified or not
            return hops <= MAX_PUSH_HOPS + 1
        if not self.enabled or verified or not max(2, self.min_hops) <= hops <= MAX_PUSH_HOPS + 1:
            return False
        if self.min_rtt_ms <= 0:
            return True
        rtts = sorted(r or 0.0 for r in rtts_s)
        return bool(rtts) and 1e3 * rtts[len(rtts) // 2] >= self.min_rtt_ms


@dataclass(frozen=True)
class SpeculativeConfig:
    """How a client drafts (``client/speculative.py``, ``client/drafts.py``).

    ``max_k`` bounds the draft tokens of one step (at most ``MAX_VERIFY_OUTPUTS`` - 1, the wire's
    bound); prompt lookup matches the last ``ngram_max`` down to ``ngram_min`` tokens.
    ``prior_acceptance`` and ``prior_token_cost`` (t_tok / t0) stand in for measurements until
    the first steps give them; ``smoothing`` is the weight of each new measurement (an EWMA);
    after ``probe_every`` steps drafting nothing, one step drafts a token again, so a rate
    measured low on one passage can recover on the next. ``adaptive=False`` always drafts
    ``max_k`` (benchmarks, and tests that must not depend on measured times).
    """

    max_k: int = 8
    ngram_max: int = 3
    ngram_min: int = 1
    prior_acceptance: float = 0.5
    prior_token_cost: float = 0.1
    smoothing: float = 0.2
    probe_every: int = 16
    adaptive: bool = True

    def __post_init__(self):
        if not 1 <= self.max_k < MAX_VERIFY_OUTPUTS:
            raise ConfigError(f"max_k must be in [1, {MAX_VERIFY_OUTPUTS - 1}], got {self.max_k}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if not (0.0 <= self.prior_acceptance < 1.0 and self.prior_token_cost >= 0.0 and 0.0 < self.smoothing <= 1.0):
            raise ConfigError("prior_acceptance in [0, 1), prior_token_cost >= 0 and smoothing in (0, 1] are required")


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
    # Output verification (client/trust/verifier.py, docs/trust.md): the share of each hop's steps re-executed
    # on another replica in the background; 2% catches a peer corrupting 10% of its steps in tens of
    # requests (a check covers the whole session); 0: off. A caught peer's outputs are regenerated
    # (client/trust/rollback.py); verify_hold makes a request await its own checks first, and
    # verify_every_request (with verify_share > 0) checks every hop of every route, never skipped.
    verify_share: float = 0.02
    verify_max_inflight: int = 4  # background checks at once; a draw beyond that is skipped
    verify_hold: bool = False
    verify_every_request: bool = False
    evidence_ttl_s: float = 3600.0  # how long this client's evidence record lives in the DHT
    # Observed service rates (client/trust/observer.py): every report_period_s, a swarm client publishes
    # the per-session decode rates it measured at the peers it used (its last report_window
    # samples per peer) as a signed ServiceReports record; coordinators cap claims (trust.md). 0: off.
    report_period_s: float = 30.0
    report_window: int = 64
    # when steps go peer to peer (docs/wan.md): rings on routes of two or more hops, loops on one
    push: PushConfig = field(default_factory=lambda: PushConfig.from_mode("ring"))
    # What an AsyncClient joins and how it generates (client/api.py documents each). A swarm:
    # initial_peers (DHT multiaddrs) with swarm_id, trusted_coordinators and swarm_model (the
    # model's name in DHT keys; None: the checkpoint's model_id), or dht_config for all of it;
    # or a fixed set of peers ("MADDR@START:END" or (maddr, start, end)). model: the local
    # checkpoint (None: the embedded default). seed: IWRR cycles (None: random).
    initial_peers: tuple[str, ...] = ()
    peers: tuple[Any, ...] = ()
    model: Optional[str] = None
    swarm_model: Optional[str] = None
    swarm_id: Optional[str] = None
    trusted_coordinators: tuple[str, ...] = ()
    dht_config: Optional[DHTConfig] = None
    seed: Optional[int] = None
    max_length: int = 4096
    speculative: Optional[str] = None  # "prompt-lookup", "draft:PATH" or None (off); docs/speculative.md
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    quant: Optional[str] = None  # int8, nf4, int4: route only over peers serving it (checked by the client)

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
        if self.speculative not in (None, "", "off", "prompt-lookup") and not (
                self.speculative.startswith("draft:") and len(self.speculative) > len("draft:")):
            raise ConfigError(f"speculative must be 'prompt-lookup', 'draft:PATH' or off, got {self.speculative!r}")
        if self.max_length < 1:
            raise ConfigError(f"max_length must be positive, not {self.max_length}")
        if self.verify_every_request and self.verify_share <= 0:
            raise ConfigError("verify_every_request (--verify-every-request) needs verify_share (--verify-share) above 0 "
                              "(0 turns verification off)")
        if self.push.enabled and not self.push.ring and self.verify_share > 0:
            # a verified route is never pushed as a chain (PushConfig.use_push): refuse rather than never push
            raise ConfigError("a chain push (PushConfig(enabled=True) without ring) needs verify_share 0: verified "
                              "routes are never pushed as a chain; a ring shows the client every hop and is verified "
                              "(docs/wan.md)")


def with_settings(config: ClientConfig, initial_peers: Sequence[str], model: Optional[str],
                  settings: dict[str, Any]) -> ClientConfig:
    """``config`` with the keyword settings of ``p2pserve.client.AsyncClient`` (ClientConfig fields) applied;
    sequences become tuples and ``peers=None`` means none."""
    changes = dict(settings)
    if initial_peers:
        changes["initial_peers"] = initial_peers
    if model is not None:
        changes["model"] = model
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(ClientConfig)})
    if unknown:
        raise TypeError(f"AsyncClient got unknown settings {unknown}: they are ClientConfig fields")
    for name in ("initial_peers", "peers", "trusted_coordinators"):
        if name in changes:
            changes[name] = tuple(changes[name] or ())
    return dataclasses.replace(config, **changes) if changes else config
