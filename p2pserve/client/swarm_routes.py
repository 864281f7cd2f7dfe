"""Route provider over the live swarm: the published plan's flows, peers' addresses and KV load.

Reads the highest-epoch trusted plan and the live ``PeerInfo`` records through the control
plane's ``Swarm`` (at most once per ``refresh_s``, so a burst of requests costs one DHT read),
keeps one IWRR :class:`Router` per plan epoch (a new epoch resets the schedulers, since the
flows changed), and masks peers over the KV high-water mark from their announced
``kv_free_tokens``. Without a plan yet, it routes over the ranges peers announce they serve;
so it does when the plan has no route left because peers flipped to new ranges after it was
published (the coordinator's next plan will carry flows over them again).

One DHT read can miss records, or all of them (a slow or failed RPC returns "nothing found"): a
peer leaves this view when its record expires or it withdraws, not when one read misses it, and
a read that fails keeps the last view (as the coordinator's ``LivePeers`` does; seen under chaos,
``tests/chaos``, where one empty read made every request of the next two seconds fail with "no
route over 0 peers").
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Optional

from p2pserve.client.hop import Hop
from p2pserve.client.routing import Masks, RouteGraph, Router
from p2pserve.clock import Clock, monotonic, wall
from p2pserve.dht.keys import RecordKind
from p2pserve.errors import NoRouteError, RoutingError
from p2pserve.types import SINK, SOURCE

log = logging.getLogger(__name__)


def graph_from_records(plan, peers: dict, num_layers: Optional[int]) -> Optional[RouteGraph]:
    """A RouteGraph from a plan (or, without one, from the peers' announced serving spans).

    ``peers`` maps peer id -> ``PeerInfo``. Peers of the plan that no longer announce themselves
    are dropped: their records expired, so they are gone (or unreachable) as far as we know. So
    are peers that announce a serving range no longer containing their span in the plan (they
    flipped to a new range after the plan was published): they would answer "range moved".
    """
    addrs = {pid: tuple(info.addrs) for pid, info in peers.items()}

    def still_serves(pid: str, span) -> bool:
        info = peers.get(pid)
        serving = info.serving if info is not None else None
        return serving is not None and serving[0] <= span[0] and span[1] <= serving[1]

    if plan is not None:
        g = RouteGraph.from_plan(plan, addrs)
        live = {p: s for p, s in g.spans.items() if still_serves(p, s)}
        def keep(x: str) -> bool:
            return x in live or x in (SOURCE, SINK)

        flows = {(u, v): r for (u, v), r in g.flows.items() if keep(u) and keep(v)}
        return RouteGraph(g.num_layers, live, flows, g.maddrs)
    if num_layers is None:
        return None
    # a peer that is loading its next range still serves its current one (make-before-break)
    serving = [(pid, *info.serving, info.addrs) for pid, info in peers.items()
               if info.state != "draining" and info.serving is not None]
    return RouteGraph.from_peers(num_layers, serving)


class SwarmRoutes:
    """Routes over a ``p2pserve.dht.swarm.Swarm`` (read through ``get_plan()`` / ``get_peers()``).

    ``kv_need_tokens`` is the request's KV estimate (prompt + max new tokens): a peer announcing
    less free KV than that is masked (Helix §5.2's high-water mark, per request). A pipeline
    gets the ``RouteProvider`` of one request from :meth:`for_request`. Only peers announcing
    the weight-only quantization ``quant`` asked for (None: full width) are routed over: the
    swarm name carries it already (``NAME@int8``), and a peer announcing another under that name
    would give different numbers than the rest of the route (``model/quant.py``).
    """

    def __init__(self, swarm, seed: int, num_layers: Optional[int] = None, refresh_s: float = 2.0,
                 clock: Clock = monotonic, wall_clock: Clock = wall, quant: Optional[str] = None):
        self.swarm = swarm
        self.quant = quant or ""
        self.seed = seed
        self.num_layers = num_layers
        self.refresh_s = refresh_s
        self.clock = clock
        self.wall_clock = wall_clock  # DHT time, which record expirations are in
        self._read_at = -1e18
        self._plan = None
        self._seen: dict = {}  # peer id -> its latest Signed[PeerInfo], until it expires or is withdrawn
        self._peers: dict = {}
        self._router: Optional[Router] = None
        self._served_router: Optional[Router] = None  # over announced serving ranges, no flows
        self._router_key = None
        self.epoch: Optional[int] = None

    async def refresh(self, force: bool = False) -> None:
        """Re-read the plan and peers if the cached copy is older than ``refresh_s``."""
        if not force and self.clock() - self._read_at < self.refresh_s:
            return
        try:
            signed = await self.swarm.get_plan()
            fresh = await self.swarm.get_peers()
        except Exception as e:  # a DHT read that failed (timeout, daemon hiccup): keep the last view
            self._read_at = self.clock()
            log.warning("reading the swarm failed (%s: %s); routing over the last view", type(e).__name__, e)
            return
        self._read_at = self.clock()
        self._peers = self._merge(fresh)
        plan = signed.plan if signed is not None else None
        if plan is not None:
            self._plan = plan  # the last plan stays valid while the leader changes
        # the ranges peers serve are part of the key: a peer may flip to a new range while the
        # epoch stays (its leader died before re-planning), and a stale router would keep
        # sending requests to a range that moved
        ranges = frozenset((pid, tuple(i.serving) if i.serving else None, i.state == "draining")
                           for pid, i in self._peers.items())
        key = (self._plan.epoch if self._plan is not None else None, ranges)
        if key != self._router_key:
            graph = graph_from_records(self._plan, self._peers, self.num_layers)
            self._router = Router(graph, seed=self.seed) if graph is not None else None
            num_layers = self.num_layers or (self._plan.num_layers if self._plan is not None else None)
            served = graph_from_records(None, self._peers, num_layers) if self._plan is not None else None
            self._served_router = Router(served, seed=self.seed) if served is not None else None
            self._router_key = key
            self.epoch = key[0]

    def _merge(self, fresh: dict) -> dict:
        """This read's records merged with those seen before that have neither expired nor been
        withdrawn; returns peer id -> PeerInfo."""
        self._seen.update(fresh)
        withdrawn = getattr(self.swarm, "withdrawn", {}).get(RecordKind.PEERS, set())
        now = self.wall_clock()
        for pid, s in list(self._seen.items()):
            if s.expiration < now or (pid not in fresh and s.signer in withdrawn):
                del self._seen[pid]
        return {pid: s.record for pid, s in self._seen.items() if s.record.quant == self.quant}

    def invalidate(self) -> None:
        """Make the next route re-read the swarm (a peer said our view of its range is stale)."""
        self._read_at = -1e18
        self._router_key = None

    @property
    def peers(self) -> dict:
        """The live peers as last read: peer id -> ``PeerInfo``."""
        return self._peers

    @property
    def plan(self):
        """The plan routes currently follow (None before the first one)."""
        return self._plan

    def kv_free(self) -> dict[str, int]:
        """Announced free KV tokens of peers that announced a KV budget."""
        return {pid: int(info.kv_free_tokens) for pid, info in self._peers.items() if info.kv_memory_bytes > 0}

    def masks_for(self, masks: Masks, kv_need_tokens: int) -> Masks:
        """The client's masks plus the KV high-water mark for this request."""
        return replace(masks, kv_free_tokens=self.kv_free(), kv_need_tokens=kv_need_tokens)

    async def route(self, masks: Masks, kv_need_tokens: int = 0) -> list[Hop]:
        """The next route (raises ``RoutingError`` if there is none)."""
        await self.refresh()
        if self._router is None:
            raise RoutingError("no plan published yet and no peer announces a serving range")
        masks = self.masks_for(masks, kv_need_tokens)
        try:
            return self._router.route(masks)
        except RoutingError as e:
            if self._served_router is None or (isinstance(e, NoRouteError) and e.overloaded):
                raise
            # The plan's routes need a peer that has since flipped to another range: route over
            # what peers serve now until the coordinator publishes flows over the new ranges.
            log.info("plan epoch %s has no route left (%s); routing over announced ranges", self.epoch, e)
            return self._served_router.route(masks)

    def for_request(self, kv_need_tokens: int) -> "RequestRoutes":
        """The ``RouteProvider`` of one request needing ``kv_need_tokens`` of KV cache."""
        return RequestRoutes(self, kv_need_tokens)


class RequestRoutes:
    """One request's ``RouteProvider`` over a shared :class:`SwarmRoutes` (its KV need applied)."""

    def __init__(self, swarm_routes: SwarmRoutes, kv_need_tokens: int):
        self.swarm_routes = swarm_routes
        self.kv_need_tokens = kv_need_tokens

    async def route(self, masks: Masks) -> list[Hop]:
        """The next route for this request."""
        return await self.swarm_routes.route(masks, self.kv_need_tokens)

    def invalidate(self) -> None:
        """Make the shared view re-read the swarm."""
        self.swarm_routes.invalidate()
