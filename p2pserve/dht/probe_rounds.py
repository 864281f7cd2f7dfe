"""One peer's link-probing rounds: whom to probe now, what to forget, and the probes themselves.

Each round reads the live peers (merged across reads by :class:`~p2pserve.dht.live_peers.LivePeers`,
so a read that misses a peer neither forgets its measured link nor probes it again), picks the
round's bounded probe set (:func:`~p2pserve.dht.probe_set.probe_round`), drops what is known of
peers outside it, and probes the targets that are due. The caller announces what came back.
"""

from __future__ import annotations

from p2pserve import clock as clocks
from p2pserve.clock import Clock
from p2pserve.dht.live_peers import LivePeers
from p2pserve.dht.probe_set import ProbeSetConfig, probe_round
from p2pserve.dht.records import LinkStat
from p2pserve.dht.view import LinkProbes, SwarmView


class ProbeRounds:
    """Probing rounds of the node ``swarm`` runs as, through ``prober``; ``wall`` is DHT time
    (record expirations)."""

    def __init__(self, swarm: SwarmView, prober: LinkProbes, *, wall: Clock = clocks.wall,
                 bounds: ProbeSetConfig = ProbeSetConfig()):
        self.swarm = swarm
        self.prober = prober
        self._wall = wall
        self._bounds = bounds
        self._live = LivePeers()
        self._round = 0

    async def step(self) -> dict[str, LinkStat]:
        """One round; returns the fresh measurements (the prober's ``results`` hold them too)."""
        peers = await self._live.read(self.swarm, self._wall())
        me = self.swarm.peer_id
        live = {pid: info.addrs for pid, info in peers.items() if pid != me}
        rtt = {pid: stat.rtt for pid, stat in self.prober.results.items()}
        targets, keep = probe_round(me, live, rtt, self._round, self._bounds)
        self._round += 1
        self.prober.forget(keep)
        return await self.prober.probe_many(targets)
