"""Where a client's :class:`~p2pserve.client.trust.verifier.Verifier` finds replicas and reply keys,
and where it publishes evidence: the swarm's live records, or a fixed list of peers."""

from __future__ import annotations

from typing import Optional, Sequence

from p2pserve.client.hop import Hop
from p2pserve.client.trust.verifier import Verifier
from p2pserve.clock import wall
from p2pserve.config import ClientConfig
from p2pserve.dht.evidence import MAX_CASES, Evidence, Mismatch
from p2pserve.dht.keys import RecordKind


def swarm_verifier(transport, model_id: str, num_layers: int, config: ClientConfig, swarm_routes, swarm,
                   failover, seed: Optional[int] = None, dtype: str = "float32") -> Verifier:
    """A verifier over the swarm: replicas and reply keys from the live ``PeerInfo`` records the
    router read; evidence announced under this client's own DHT key."""

    def replicas(start: int, end: int, exclude: frozenset) -> list[Hop]:
        banned = failover.masks().banned
        return [Hop(pid, start, end, tuple(info.addrs)) for pid, info in sorted(swarm_routes.peers.items())
                if pid not in exclude and pid not in banned and info.state != "draining"
                and info.serving is not None and info.serving[0] <= start and end <= info.serving[1]]

    def reply_key(peer: str) -> str:
        info = swarm_routes.peers.get(peer)
        return info.reply_key if info is not None else ""

    async def publish(cases: list[Mismatch]) -> None:
        record = Evidence(model=swarm.config.model, reporter_id=swarm.peer_id, cases=cases[-MAX_CASES:],
                          timestamp=wall())
        await swarm.announce(RecordKind.EVIDENCE, record, ttl=config.evidence_ttl_s)

    return Verifier(transport, model_id, num_layers, config, replicas, reply_key, publish, seed, dtype=dtype)


def peer_list_verifier(transport, model_id: str, num_layers: int, config: ClientConfig, peers: Sequence[Hop],
                       failover, seed: Optional[int] = None, dtype: str = "float32") -> Verifier:
    """A verifier over a fixed set of peers: no reply keys are known (signatures are not checked
    and no evidence is published), mismatches ban the culprit in this client only."""

    def replicas(start: int, end: int, exclude: frozenset) -> list[Hop]:
        banned = failover.masks().banned
        return [Hop(h.peer_id, start, end, h.maddrs) for h in peers
                if h.peer_id not in exclude and h.peer_id not in banned and h.start <= start and end <= h.end]

    return Verifier(transport, model_id, num_layers, config, replicas, lambda peer: "", None, seed, dtype=dtype)
