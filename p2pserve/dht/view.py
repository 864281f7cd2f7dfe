"""The control plane's seams: what the roles may ask of the swarm, as typed protocols.

The coordinator, the peer's agent and the client never see hivemind: they hold a
:class:`SwarmView` (or the read-only :class:`SwarmReader`) and, for link probes, a
:class:`LinkProbes`. :class:`p2pserve.dht.swarm.Swarm` and :class:`p2pserve.dht.prober.LinkProber`
implement them over hivemind; :class:`p2pserve.testing.FakeSwarm` implements :class:`SwarmView`
in memory for unit tests. This module imports no hivemind, so a role can depend on it freely.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Iterable, Mapping, Optional, Protocol, TypeVar

from p2pserve.config import DHTConfig, ProberConfig
from p2pserve.dht.election import SignedPlan
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.records import CoordinatorCandidate, LinkInfo, LinkStat, PeerInfo, Plan

R = TypeVar("R")


@dataclass(frozen=True)
class Signed(Generic[R]):
    """A validated record, the public key that signed it and its DHT expiration time."""

    record: R
    signer: str
    expiration: float


class SwarmReader(Protocol):
    """The read side a client's router needs: the plan to follow and the live peers."""

    async def get_peers(self) -> dict[str, Signed[PeerInfo]]:
        """Live, valid PeerInfo records by peer id."""
        ...

    async def get_plan(self) -> Optional[SignedPlan]:
        """The plan to follow (highest trusted epoch; the last one seen if none is found now)."""
        ...


class SwarmView(SwarmReader, Protocol):
    """One node's handle on the records of one model in one swarm: its own records to write,
    everyone's validated records to read."""

    config: DHTConfig
    #: signers whose entry of a kind was withdrawn (a tombstone) at the last read of that kind
    withdrawn: Mapping[RecordKind, set[str]]

    @property
    def peer_id(self) -> str:
        """This node's peer id."""
        ...

    @property
    def public_key(self) -> str:
        """The OpenSSH text of the key that signs this node's records."""
        ...

    async def announce_peer(self, info: PeerInfo) -> bool:
        """Store (or refresh) this node's PeerInfo."""
        ...

    async def announce_links(self, info: LinkInfo) -> bool:
        """Store (or refresh) this node's LinkInfo."""
        ...

    async def announce_candidate(self, cand: CoordinatorCandidate) -> bool:
        """Store (or refresh) this coordinator's candidacy."""
        ...

    async def publish_plan(self, plan: Plan) -> bool:
        """Store (or refresh) the plan this coordinator leads with."""
        ...

    async def announce(self, kind: RecordKind, record, ttl: Optional[float] = None) -> bool:
        """Store (or refresh) this node's record of another kind (reports, evidence)."""
        ...

    async def read(self, kind: RecordKind, cls: type) -> list[Signed]:
        """Every live, valid record of ``kind`` decoded as ``cls``, with its signer."""
        ...

    async def withdraw(self, kind: RecordKind) -> bool:
        """Withdraw this node's record of ``kind`` (readers drop it at once)."""
        ...

    async def withdraw_all(self) -> None:
        """Withdraw every record this node announced."""
        ...

    async def get_links(self) -> dict[str, Signed[LinkInfo]]:
        """Live, valid LinkInfo records by measuring peer id."""
        ...

    async def get_candidates(self) -> list[Signed[CoordinatorCandidate]]:
        """Live coordinator candidacies (trusted ones only, where trust is configured)."""
        ...

    async def get_plans(self) -> list[SignedPlan]:
        """All live plans signed by trusted coordinators."""
        ...


class LinkProbes(Protocol):
    """What the peer's agent needs of a link prober: serve probes, measure links, keep results."""

    config: ProberConfig

    async def start(self) -> None:
        """Start answering other peers' probes."""
        ...

    async def stop(self) -> None:
        """Stop answering probes."""
        ...

    @property
    def results(self) -> dict[str, LinkStat]:
        """The current estimate of each measured link, by peer id."""
        ...

    def forget(self, keep: Iterable[str]) -> None:
        """Drop what is known about peers not in ``keep``."""
        ...

    async def probe_many(self, targets: dict[str, list[str]]) -> dict[str, LinkStat]:
        """Probe the targets that are due (peer id -> multiaddrs); returns fresh measurements."""
        ...
