"""What the coordinator plans from: the swarm's live records at one instant (pure, no I/O).

:class:`Snapshot` holds validated peers and links; :class:`Summary` is the part of it that the
re-plan decision compares between rounds. The peers it is built from come through
:class:`~p2pserve.dht.live_peers.LivePeers`, which keeps peers across reads that miss them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from p2pserve.dht.records import LinkInfo, LinkStat, PeerInfo
from p2pserve.types import LayerRange


@dataclass(frozen=True)
class Snapshot:
    """Validated live records at one instant: peers by id and links ``(from, to) -> stat``."""

    peers: Mapping[str, PeerInfo]
    links: Mapping[tuple[str, str], LinkStat] = field(default_factory=dict)

    @staticmethod
    def from_records(peers: Mapping[str, PeerInfo], link_infos: Sequence[LinkInfo]) -> "Snapshot":
        """Flatten LinkInfo records into directed link stats between live peers only."""
        links = {}
        for li in link_infos:
            if li.peer_id not in peers:
                continue
            for other, stat in li.links.items():
                if other in peers:
                    links[(li.peer_id, other)] = stat
        return Snapshot(dict(peers), links)

    def plannable(self) -> list[str]:
        """Peers the planner may give layers to: profiled and not draining (sorted ids)."""
        return sorted(
            pid for pid, p in self.peers.items()
            if p.state != "draining" and p.max_layers > 0 and len(p.throughput_decode) == p.max_layers
        )

    def serving_now(self) -> dict[str, LayerRange]:
        """Ranges peers serve now (what flows are computed over); draining peers excluded."""
        return {pid: p.serving for pid, p in self.peers.items() if p.serving is not None and p.state != "draining"}


@dataclass(frozen=True)
class Summary:
    """What the re-plan decision looks at."""

    peers: frozenset[str]
    spans: tuple[tuple[str, LayerRange], ...]
    bandwidth: Mapping[tuple[str, str], float]
    link_ceiling: float = float("inf")  # bytes/s above which no link can limit a flow

    @staticmethod
    def of(s: Snapshot, activation_bytes: Optional[int] = None) -> "Summary":
        """Summarize a snapshot; with ``activation_bytes``, links faster than any peer's best
        decode throughput could ever use are marked as unable to bind."""
        ceiling = float("inf")
        if activation_bytes:
            best = max((max(p.throughput_decode, default=0.0) for p in s.peers.values()), default=0.0)
            if best > 0:
                ceiling = best * activation_bytes
        return Summary(
            frozenset(s.plannable()),
            tuple(sorted(s.serving_now().items())),
            {k: v.bandwidth for k, v in s.links.items()},
            ceiling,
        )
