"""Per-request pipelines by interleaved weighted round-robin over a plan's flows (Helix §5.1).

The plan's flow graph has a vertex per peer plus ``source`` and ``sink``. An edge ``u -> v``
carries ``flows[(u, v)]`` tokens/s. With partial inference a hop into ``v`` starts where ``u``
stopped: ``v`` serves ``[s_v, e_v)`` and the edge exists when ``s_v <= e_u < e_v``; ``v`` then runs
``[e_u, e_v)`` (``source`` "stops" at layer 0). A route is a walk source -> ... -> sink, and each
step of the walk is chosen by the IWRR scheduler bound to the current vertex, whose candidates
are the vertex's out-edges weighted by their flow. Many clients, each seeded differently (their
cycles start at different offsets and break ties in different orders), therefore spread their
requests over the graph in proportion to the max-flow solution, without bursts.

Masks (Helix §5.2 and failover): a candidate is skipped when the client banned it, when it
answered "overloaded", or when its announced free KV cache is below the request's high-water
mark. Masked slots of the cycle are skipped, so the remaining candidates keep their relative
weights. A vertex whose every candidate is masked makes the walk backtrack; if no walk exists,
:class:`NoRouteError` says why, and whether lifting the load masks alone would give a route
(then every route is overloaded, which the HTTP API reports as 429 rather than 503).

When the flows offer no unmasked route but the peers' spans still connect (the plan predates a
failure, or there is no plan at all: a fixed list of peers), the walk falls back to every valid
edge, weighted by the number of layers the hop covers, so longer hops (shorter chains) win.

Everything here is pure: no I/O, randomness only from the injected seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

from p2pserve.client.hop import Hop
from p2pserve.errors import NoRouteError
from p2pserve.types import SINK, SOURCE, LayerRange


# ----------------------------------------------------------------------------- masks


@dataclass(frozen=True)
class Masks:
    """Which peers a walk must avoid, and why.

    ``kv_free_tokens`` holds the free KV cache (tokens) peers announced; a peer with less than
    ``kv_need_tokens`` free is over the high-water mark for this request. Peers absent from the
    mapping are not KV-masked (no announcement yet means no evidence of load).
    """

    banned: frozenset[str] = frozenset()
    overloaded: frozenset[str] = frozenset()
    kv_free_tokens: Mapping[str, int] = field(default_factory=dict)
    kv_need_tokens: int = 0

    def reason(self, peer: str) -> Optional[str]:
        """Why ``peer`` is masked, or None when it may be used."""
        if peer in self.banned:
            return "banned"
        if peer in self.overloaded:
            return "overloaded"
        free = self.kv_free_tokens.get(peer)
        if free is not None and self.kv_need_tokens > 0 and free < self.kv_need_tokens:
            return f"KV high-water mark ({free} tokens free, {self.kv_need_tokens} needed)"
        return None

    def without_load(self) -> "Masks":
        """The same masks with the load-based ones (overloaded, KV) lifted."""
        return Masks(banned=self.banned)


# ----------------------------------------------------------------------------- IWRR


class IWRR:
    """Interleaved weighted round-robin over integer weights.

    The cycle is ``max(w)`` rounds; round ``r`` visits, in order, every candidate with
    ``w > r``. Over one cycle candidate i is chosen exactly ``w_i`` times, interleaved rather than
    in bursts. Candidates are ordered by decreasing weight (ties in a seeded random order), so a
    round ends at the first candidate whose weight is too small: each pick is O(1) amortised.
    The cycle starts at a seeded random offset, which is what decorrelates many clients.
    """

    def __init__(self, weights: Mapping[str, int], rng: random.Random):
        items = [(c, int(w)) for c, w in weights.items() if w > 0]
        rng.shuffle(items)
        items.sort(key=lambda cw: -cw[1])  # stable: ties keep the shuffled order
        self.candidates = [c for c, _ in items]
        self.weights = [w for _, w in items]
        self.cycle_len = sum(self.weights)
        self._round = 0
        self._index = -1
        if self.cycle_len:
            self._seek(rng.randrange(self.cycle_len))

    def _seek(self, slot: int) -> None:
        """Start so that the next pick is slot ``slot`` of the cycle (O(max weight)).

        A random starting slot is what keeps clients from all beginning with candidate 0.
        """
        r = 0
        while True:
            eligible = sum(1 for w in self.weights if w > r)  # weights are sorted descending
            if slot < eligible:
                self._round, self._index = r, slot - 1
                return
            slot -= eligible
            r += 1

    def _advance(self) -> str:
        """Move to the next slot of the cycle and return its candidate."""
        self._index += 1
        if self._index >= len(self.candidates) or self.weights[self._index] <= self._round:
            self._index = 0
            self._round = (self._round + 1) % self.weights[0]
        return self.candidates[self._index]

    def pick(self, allowed) -> Optional[str]:
        """The next candidate in the cycle for which ``allowed(c)`` holds (None if none does).

        Masked slots are consumed, so among the allowed candidates the shares stay ``w_i / sum w``.
        """
        if not self.candidates:
            return None
        for _ in range(self.cycle_len):
            c = self._advance()
            if allowed(c):
                return c
        return None


def quantize(rates: Mapping[str, float], resolution: int) -> dict[str, int]:
    """Integer IWRR weights proportional to ``rates``; the largest becomes ``resolution``.

    Any positive rate gets weight >= 1 (a small flow is still a valid choice). The relative error
    of a share is at most ``0.5 / resolution`` of the largest rate.
    """
    top = max((r for r in rates.values() if r > 0), default=0.0)
    if top <= 0:
        return {}
    return {c: max(1, round(r / top * resolution)) for c, r in rates.items() if r > 0}


# ----------------------------------------------------------------------------- the graph


@dataclass(frozen=True)
class RouteGraph:
    """What routing needs from a plan: spans served now, flows, and peer addresses.

    ``flows`` maps ``(u, v)`` (peer ids, ``"source"``/``"sink"``) to tokens/s. An empty mapping
    means "no plan": every valid edge is usable, weighted by the layers its hop covers.
    """

    num_layers: int
    spans: Mapping[str, LayerRange]
    flows: Mapping[tuple[str, str], float] = field(default_factory=dict)
    maddrs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def from_plan(cls, plan, maddrs: Mapping[str, Sequence[str]] = {}) -> "RouteGraph":
        """Build from a ``p2pserve.dht.records.Plan`` (duck-typed: spans, flows, num_layers)."""
        flows: dict[tuple[str, str], float] = {}
        for f in plan.flows:
            flows[(f.src, f.dst)] = flows.get((f.src, f.dst), 0.0) + float(f.rate)
        return cls(
            num_layers=plan.num_layers,
            spans={p: (int(s), int(e)) for p, (s, e) in plan.spans.items()},
            flows=flows,
            maddrs={p: tuple(a) for p, a in maddrs.items()},
        )

    @classmethod
    def from_peers(cls, num_layers: int, peers: Iterable[tuple[str, int, int, Sequence[str]]]) -> "RouteGraph":
        """A graph without flows over known peers ``(peer_id, start, end, maddrs)``."""
        spans, addrs = {}, {}
        for peer_id, start, end, maddrs in peers:
            spans[peer_id] = (int(start), int(end))
            addrs[peer_id] = tuple(maddrs)
        return cls(num_layers=num_layers, spans=spans, maddrs=addrs)

    def stop_layer(self, u: str) -> int:
        """The layer a walk has reached after visiting ``u``."""
        return 0 if u == SOURCE else self.spans[u][1]

    def valid_edge(self, u: str, v: str) -> bool:
        """Whether a hop into ``v`` can follow ``u`` (partial inference allowed)."""
        if v == SINK:
            return u != SOURCE and self.stop_layer(u) == self.num_layers
        if v not in self.spans or v == u:
            return False
        at = self.stop_layer(u)
        s, e = self.spans[v]
        return s <= at < e

    def flow_edges(self, u: str) -> dict[str, float]:
        """Out-edges of ``u`` that carry flow in the plan (invalid ones are dropped)."""
        return {v: r for (a, v), r in self.flows.items() if a == u and r > 0 and self.valid_edge(u, v)}

    def all_edges(self, u: str) -> dict[str, float]:
        """Every valid out-edge of ``u`` (to peers), weighted by the layers the hop covers."""
        at = self.stop_layer(u)
        return {v: float(e - at) for v, (s, e) in self.spans.items() if self.valid_edge(u, v)}


def route_exists(graph: RouteGraph, masks: Masks) -> bool:
    """Whether any source -> sink walk over valid edges avoids the masked peers (no state)."""
    reach: dict[str, bool] = {}

    def ok(u: str) -> bool:
        if graph.stop_layer(u) == graph.num_layers:
            return True
        if u not in reach:
            reach[u] = False  # spans strictly advance, so there are no cycles; this is memo only
            reach[u] = any(masks.reason(v) is None and ok(v) for v in graph.all_edges(u))
        return reach[u]

    return ok(SOURCE)


# ----------------------------------------------------------------------------- the router


class Router:
    """Builds per-request pipelines over one ``RouteGraph`` (one plan epoch).

    Keeps one IWRR scheduler per vertex over the plan's flows and one over all valid edges (the
    fallback). ``seed`` must differ between clients; inject it, don't derive it from time.
    """

    def __init__(self, graph: RouteGraph, seed: int, resolution: int = 100):
        self.graph = graph
        self.resolution = resolution
        self._rng = random.Random(seed)
        self._flow_sched: dict[str, IWRR] = {}
        self._any_sched: dict[str, IWRR] = {}

    def _scheduler(self, u: str, fallback: bool) -> IWRR:
        table = self._any_sched if fallback else self._flow_sched
        if u not in table:
            edges = self.graph.all_edges(u) if fallback else self.graph.flow_edges(u)
            table[u] = IWRR(quantize(edges, self.resolution), random.Random(self._rng.getrandbits(64)))
        return table[u]

    def _walk(self, u: str, masks: Masks, fallback: bool, dead: set[str]) -> Optional[list[str]]:
        """Vertices after ``u`` to the last peer, or None; ``dead`` memoises dead ends."""
        if u != SOURCE and self.graph.stop_layer(u) == self.graph.num_layers:
            return []
        sched = self._scheduler(u, fallback)
        tried: set[str] = set()
        while True:
            v = sched.pick(lambda c: c not in tried and c not in dead and masks.reason(c) is None)
            if v is None:
                dead.add(u)
                return None
            rest = self._walk(v, masks, fallback, dead)
            if rest is not None:
                return [v] + rest
            tried.add(v)

    def route_ids(self, masks: Masks = Masks()) -> list[str]:
        """Peer ids of the next pipeline (source and sink excluded); raises NoRouteError."""
        if self.graph.flows:
            path = self._walk(SOURCE, masks, fallback=False, dead=set())
            if path is not None:
                return path
        path = self._walk(SOURCE, masks, fallback=True, dead=set())
        if path is not None:
            return path
        reasons = {p: r for p in self.graph.spans if (r := masks.reason(p)) is not None}
        overloaded = route_exists(self.graph, masks.without_load())
        uncovered = _uncovered_layers(self.graph, masks)
        why = "every route passes an overloaded peer" if overloaded else (
            f"no usable peer serves layer {uncovered}" if uncovered is not None else "the usable peers' spans do not connect"
        )
        masked = ", ".join(f"{p[-8:]} ({r})" for p, r in sorted(reasons.items())) or "none"
        raise NoRouteError(f"no route over {len(self.graph.spans)} peers: {why}; masked: {masked}", reasons, overloaded)

    def route(self, masks: Masks = Masks()) -> list[Hop]:
        """The next pipeline as hops: each runs from where the previous stopped to its span end."""
        hops, at = [], 0
        for peer in self.route_ids(masks):
            end = self.graph.spans[peer][1]
            hops.append(Hop(peer_id=peer, start=at, end=end, maddrs=tuple(self.graph.maddrs.get(peer, ()))))
            at = end
        return hops


def _uncovered_layers(graph: RouteGraph, masks: Masks) -> Optional[int]:
    """The first layer no unmasked peer serves (None if every layer is served)."""
    for layer in range(graph.num_layers):
        if not any(s <= layer < e and masks.reason(p) is None for p, (s, e) in graph.spans.items()):
            return layer
    return None
