"""A synthetic swarm of announced peers for control-plane benchmarks: every node of a planner
:class:`~p2pserve.placement.topology.Topology` (a generated cluster) as a signed identity with its
``PeerInfo`` and ``LinkInfo``, many identities per DHT node (:mod:`p2pserve.dht.multi_identity`).

Records carry what a real peer would announce for the planner: its throughput table, memory,
state and served range, and the links the topology has from it (bandwidth in bytes/s, round trip
twice the one-way latency), so the coordinator reads the swarm the topology describes.
"""

from __future__ import annotations

import asyncio
from typing import Mapping, Optional, Sequence

from p2pserve.clock import wall
from p2pserve.dht.records import LinkInfo, LinkStat, PeerInfo
from p2pserve.dht.swarm import Swarm
from p2pserve.placement.topology import Topology
from p2pserve.types import LayerRange


def peer_info(topo: Topology, i: int, model: str, peer_id: str, serving: Optional[LayerRange] = None) -> PeerInfo:
    """Node ``i`` of ``topo`` as the PeerInfo its peer would announce."""
    node = topo.nodes[i]
    k = node.max_layers
    return PeerInfo(model=model, peer_id=peer_id, device=node.gpu_type,
                    weights_memory_bytes=int(node.memory_bytes), kv_memory_bytes=1 << 30,
                    throughput_decode=list(node.throughput[1:]), throughput_prefill=list(node.throughput[1:]),
                    max_layers=k, serving=serving, state="serving" if serving else "joining",
                    kv_free_tokens=100_000, version="synthetic", timestamp=wall())


def link_infos(topo: Topology, peer_ids: Sequence[str], model: str) -> list[LinkInfo]:
    """Per node, its links in ``topo`` to other nodes as a LinkInfo (one pass over the links)."""
    links: list[dict[str, LinkStat]] = [{} for _ in peer_ids]
    now = wall()
    for link in topo.links:
        if 0 <= link.src < len(peer_ids) and 0 <= link.dst < len(peer_ids):
            links[link.src][peer_ids[link.dst]] = LinkStat(bandwidth=topo.convention.bytes_per_s(link.bandwidth),
                                                           rtt=2 * link.latency_s, measured_at=now)
    return [LinkInfo(model=model, peer_id=pid, links=ls, timestamp=now) for pid, ls in zip(peer_ids, links)]


async def announce_all(swarms: Sequence[Swarm], topo: Topology, model: str,
                       serving: Mapping[str, LayerRange] = {}, links: bool = True, batch: int = 4) -> int:
    """Announce every identity's PeerInfo (and LinkInfo), ``batch`` stores at a time; returns how
    many stores succeeded. ``serving``: peer id -> the range it serves."""
    ids = [s.peer_id for s in swarms]
    jobs = [s.announce_peer(peer_info(topo, i, model, s.peer_id, serving.get(s.peer_id))) for i, s in enumerate(swarms)]
    if links:
        jobs += [s.announce_links(li) for s, li in zip(swarms, link_infos(topo, ids, model))]
    ok = 0
    for x in range(0, len(jobs), batch):
        ok += sum(1 for r in await asyncio.gather(*jobs[x:x + batch], return_exceptions=True) if r is True)
    return ok
