"""A coordinator's settings: planning (:class:`CoordinatorConfig`) and its own compute probes
(:class:`ComputeProbeConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from p2pserve.errors import ConfigError


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
    # Verification (docs/trust.md): a trusted verifier's case (its DHT key or peer id) excludes a
    # peer for exclusion_s; anyone else's is an accusation the leader re-executes on
    # retrial_replicas replicas (coordinator/retrial.py).
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
class ComputeProbeConfig:
    """How often and how hard the coordinator probes each peer's compute (0 ``interval_s``: off)."""

    interval_s: float = 60.0  # each peer at most once per interval
    steps: int = 8  # timed decode Forwards per probe (>= CoordinatorConfig.min_report_samples to count)
    gap_s: float = 0.5  # pause between two peers' probes
    timeout_s: float = 10.0  # one round trip
    max_age_s: float = 600.0  # a result older than this is dropped from the report
    rotate_s: float = 600.0  # the probing node's identity is replaced this often
    max_rtt_credit: float = 4.0  # as CoordinatorConfig.max_rtt_credit
    token_id_bound: int = 256  # token ids sent to a span starting at layer 0 (every vocabulary has them)
