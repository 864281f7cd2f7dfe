"""``SwarmSnapshot``: every validated record of one swarm and model, read at one instant."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Optional

from p2pserve import clock as clocks
from p2pserve.clock import Clock
from p2pserve.dht.election import SignedPlan
from p2pserve.dht.evidence import Evidence
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.records import CoordinatorCandidate, LinkInfo, PeerInfo
from p2pserve.dht.reports import ServiceReports


@dataclass(frozen=True)
class SwarmSnapshot:
    """What a reader saw: live peers by id, links, coordinator candidacies, the plan it follows,
    clients' service reports and verification evidence (``Signed`` records), at ``taken_at``
    (DHT time). Everything here passed the readers' validation; strings are still untrusted."""

    peers: dict[str, PeerInfo] = field(default_factory=dict)
    links: list[LinkInfo] = field(default_factory=list)
    candidates: list[CoordinatorCandidate] = field(default_factory=list)
    plan: Optional[SignedPlan] = None
    reports: list[ServiceReports] = field(default_factory=list)
    evidence: list = field(default_factory=list)
    taken_at: float = 0.0


async def read_snapshot(reader, clock: Clock = clocks.wall) -> SwarmSnapshot:
    """One read of every kind through ``reader`` (a ``dht.view.SwarmView``)."""
    peers = {pid: s.record for pid, s in (await reader.get_peers()).items()}
    links = [s.record for s in (await reader.get_links()).values()]
    cands = [s.record for s in await reader.get_candidates()]
    reports = [s.record for s in await reader.read(RecordKind.REPORTS, ServiceReports)]
    evidence = await reader.read(RecordKind.EVIDENCE, Evidence)
    return SwarmSnapshot(peers, links, cands, await reader.get_plan(), reports, evidence, clock())


async def read_settled(reader, attempts: int = 3, clock: Clock = clocks.wall) -> SwarmSnapshot:
    """:func:`read_snapshot`, retried while no peer or no plan is seen: a node that just joined
    may not reach every replica on its first read."""
    snap = SwarmSnapshot()
    for attempt in range(attempts):
        snap = await read_snapshot(reader, clock)
        if snap.peers and snap.plan is not None:
            break
        await asyncio.sleep(0.5 * (attempt + 1))
    return snap
