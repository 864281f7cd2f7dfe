"""The live peers across DHT reads: every read merged with the peers seen before.

A thin read (``read``) over the pure merge (``update``). The coordinator plans from the live
peers, and a peer's probing rounds (``dht/probe_rounds.py``) choose their targets and keep their
measurements by them.
"""

from __future__ import annotations

from typing import Mapping

from p2pserve.dht.keys import RecordKind
from p2pserve.dht.records import PeerInfo
from p2pserve.dht.view import Signed, SwarmView
from p2pserve.types import PeerId


class LivePeers:
    """Fresh reads merged with peers seen before whose records have not expired yet.

    One DHT read can miss an entry (a slow replica, a timeout); treating that as a departure
    would move layers back and forth in a plan, or forget a measured link and probe it again.
    A peer leaves when its record expires or it withdraws (tombstone), not when one read misses it.
    """

    def __init__(self) -> None:
        self._seen: dict[PeerId, Signed[PeerInfo]] = {}

    async def read(self, swarm: SwarmView, now: float) -> dict[str, PeerInfo]:
        """Read the peers through ``swarm`` and merge the read (``now``: DHT time)."""
        fresh = await swarm.get_peers()
        return self.update(fresh, swarm.withdrawn.get(RecordKind.PEERS, set()), now)

    def update(self, fresh: Mapping[PeerId, Signed[PeerInfo]], withdrawn: set[str], now: float) -> dict[str, PeerInfo]:
        """Merge one read (``withdrawn``: signers that left on purpose); returns the live peers."""
        self._seen.update(fresh)
        for pid in list(self._seen):
            s = self._seen[pid]
            if s.expiration < now or (pid not in fresh and s.signer in withdrawn):
                del self._seen[pid]
        return {pid: s.record for pid, s in self._seen.items()}
