"""The live peers across DHT reads: every read merged with the peers seen before (pure, no I/O).

The coordinator plans from them and a peer's link prober chooses its targets and keeps its
measurements by them (``peer/agent.py``).
"""

from __future__ import annotations

from typing import Mapping

from p2pserve.dht.records import PeerInfo
from p2pserve.dht.view import Signed
from p2pserve.types import PeerId


class LivePeers:
    """Fresh reads merged with peers seen before whose records have not expired yet.

    One DHT read can miss an entry (a slow replica, a timeout); treating that as a departure
    would move layers back and forth in a plan, or forget a measured link and probe it again.
    A peer leaves when its record expires or it withdraws (tombstone), not when one read misses it.
    """

    def __init__(self) -> None:
        self._seen: dict[PeerId, Signed[PeerInfo]] = {}

    def update(self, fresh: Mapping[PeerId, Signed[PeerInfo]], withdrawn: set[str], now: float) -> dict[str, PeerInfo]:
        """Merge one read (``withdrawn``: signers that left on purpose); returns the live peers."""
        self._seen.update(fresh)
        for pid in list(self._seen):
            s = self._seen[pid]
            if s.expiration < now or (pid not in fresh and s.signer in withdrawn):
                del self._seen[pid]
        return {pid: s.record for pid, s in self._seen.items()}
