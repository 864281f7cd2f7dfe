"""``DHTConfig``: everything the DHT layer needs (to be folded into ``p2pserve/config.py``).

Refresh periods and the tolerated clock skew fix every record's TTL
(:func:`p2pserve.dht.records.ttl_for`); tests shrink them to fractions of a second.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from p2pserve.dht.records import ttl_for
from p2pserve.errors import ConfigError


@dataclass(frozen=True)
class DHTConfig:
    """Configuration of one node's view of one swarm + model."""

    model: str
    swarm_id: str = "p2pserve"
    initial_peers: tuple[str, ...] = ()
    # where the libp2p daemon listens / what it tells others; 0.0.0.0 for a real swarm
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    identity_path: Optional[str] = None  # libp2p identity (peer id); None = random each start
    key_path: Optional[str] = None  # RSA key that signs this node's records; None = ephemeral
    trusted_coordinators: tuple[str, ...] = ()  # OpenSSH public keys; empty = open swarm
    use_relay: bool = True  # may connect *through* relays (needed to reach NATed peers)
    use_auto_relay: bool = False  # look for a relay to become reachable when behind NAT
    client_mode: bool = False  # outgoing-only node (stores nothing for others)
    # refresh periods in seconds
    peer_refresh: float = 5.0
    link_refresh: float = 60.0
    candidate_refresh: float = 3.0
    plan_refresh: float = 10.0
    max_clock_skew: float = 2.0
    rpc_timeout: float = 10.0  # one DHT get/store
    reject_log_interval: float = 60.0  # the same rejected record is logged at most this often
    # a loaded peer keeps its old range at most this long for the peers taking its dropped
    # layers to load them (make-before-break, see p2pserve/peer/handover.py)
    handover_max_wait: float = 120.0

    def __post_init__(self) -> None:
        for name in ("peer_refresh", "link_refresh", "candidate_refresh", "plan_refresh", "rpc_timeout"):
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

    def replace(self, **changes) -> "DHTConfig":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)
