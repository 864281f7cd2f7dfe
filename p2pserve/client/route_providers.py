"""Where a pipeline gets its routes: the :class:`RouteProvider` protocol and the providers that
need no control plane (a fixed set of peers, or explicit chains).

The swarm's provider, over the published plan, is :mod:`p2pserve.client.swarm_routes`.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from p2pserve.client.hop import Hop
from p2pserve.client.routing import Masks, RouteGraph, Router
from p2pserve.errors import NoRouteError


class RouteProvider(Protocol):
    """What a :class:`~p2pserve.client.pipeline.Pipeline` asks for routes."""

    async def route(self, masks: Masks) -> list[Hop]:
        """The next route avoiding ``masks``; raises ``RoutingError`` (``NoRouteError``) if none."""

    def invalidate(self) -> None:
        """Our view of the swarm is stale (a peer said "range moved"): re-read it before the next route."""


class PeerListRoutes:
    """Routes over a fixed set of known peers (no control plane): IWRR over every valid edge.

    ``peers`` are hops covering each peer's whole range; routes prefer long hops (see routing.py).
    """

    def __init__(self, num_layers: int, peers: Sequence[Hop], seed: int):
        graph = RouteGraph.from_peers(num_layers, [(h.peer_id, h.start, h.end, h.maddrs) for h in peers])
        self.router = Router(graph, seed=seed)

    async def route(self, masks: Masks) -> list[Hop]:
        """The next IWRR route over the known peers."""
        return self.router.route(masks)

    def invalidate(self) -> None:
        """Nothing to re-read: the set of peers is fixed."""


class ChainListRoutes:
    """Routes from an ordered list of candidate chains: the first whose peers are all usable."""

    def __init__(self, chains: Sequence[Sequence[Hop]]):
        self.chains = [list(c) for c in chains]

    async def route(self, masks: Masks) -> list[Hop]:
        """The first chain with no masked peer."""
        reasons: dict[str, str] = {}
        overloaded = False  # some chain is blocked by load alone (it would work once peers free up)
        for chain in self.chains:
            bad = {h.peer_id: r for h in chain if (r := masks.reason(h.peer_id)) is not None}
            if not bad:
                return list(chain)
            reasons.update(bad)
            overloaded |= all(r != "banned" for r in bad.values())
        raise NoRouteError(f"every candidate chain has a masked peer: {reasons}", reasons, overloaded)

    def invalidate(self) -> None:
        """Nothing to re-read: the chains are fixed."""
