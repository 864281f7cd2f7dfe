"""Every member's view of the swarm (:class:`DHTConfig`), link probing (:class:`ProberConfig`) and
the bootstrap node (:class:`BootstrapConfig`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from p2pserve.errors import ConfigError


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

    def replace(self, **changes: Any) -> "DHTConfig":
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
class BootstrapConfig:
    """A long-lived DHT node that holds no model (``p2pserve bootstrap``)."""

    initial_peers: tuple[str, ...] = ()  # other bootstrap nodes to join
    # a fixed port (with a persistent identity) keeps the multiaddr, and so everyone's config, stable
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/31337",)
    announce_maddrs: tuple[str, ...] = ()
    identity_path: Optional[str] = None
    use_relay: bool = True
    maddrs_file: Optional[str] = None  # also write the multiaddrs here (scripts, tests)
