"""How a request's tokens travel, and speculation: the client's place and the transport mode.

The coordinator of a Helix cluster file is both the source and the sink, placed by the file's
source/sink links. Here the *client* takes that place, and two things about it are variable:

* **where it is** (``client_region``): the cluster's regions are the groups of nodes joined by
  links of at most ``intra_max_s`` one-way latency (:func:`node_regions`); a client in region r
  reaches node v over a link like the one between a node of r and v (:func:`relocate_client`);
* **how a step travels** (``mode``): ``push`` (peer to peer: client -> first stage -> ... -> last
  stage -> client, the Helix simulator's model) or ``client`` (client-driven: every stage's
  output comes back to the client, which sends it to the next stage; each hop is a client -> peer
  -> client round trip over the client's links; :class:`ClientRelay`).

Speculation (``spec_k`` > 0): each decode step carries the pending token and k draft tokens
(k + 1 positions of compute and activations at every stage) and yields 1 + n tokens, n the
accepted drafts: draft position j is accepted with probability ``acceptance`` given the ones before
it were (a seeded draw), so a step yields :func:`expected_tokens` = (1 - a^(k+1)) / (1 - a) on
average, as ``client/speculative.py`` models it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from p2pserve.errors import ConfigError
from p2pserve.placement.topology import LinkSpec, Topology
from p2pserve.sim.link import Link
from p2pserve.sim.request import Query
from p2pserve.types import SINK_INDEX, SOURCE_INDEX

if TYPE_CHECKING:  # the cluster imports this module: name it only in annotations, as a string
    from p2pserve.sim.graph import StageGraph
    from p2pserve.sim.node import Node

TRANSPORT_MODES = ("push", "client")


@dataclass(frozen=True)
class TransportConfig:
    """The client's region (None: the cluster file's source/sink links), the transport mode,
    and speculation (``spec_k`` draft tokens a step at per-position ``acceptance``)."""

    mode: str = "push"
    client_region: int | None = None
    spec_k: int = 0
    acceptance: float = 0.0
    intra_max_s: float = 0.005  # links this fast or faster join two nodes into one region

    def __post_init__(self):
        if self.mode not in TRANSPORT_MODES:
            raise ConfigError(f"transport mode must be one of {TRANSPORT_MODES}, not {self.mode!r}")
        if self.spec_k < 0 or not 0.0 <= self.acceptance <= 1.0:
            raise ConfigError("speculation needs spec_k >= 0 and an acceptance in [0, 1]")
        if self.client_region is not None and self.client_region < 0:
            raise ConfigError(f"client region must be >= 0, got {self.client_region}")

    def describe(self) -> dict:
        """JSON-friendly summary for a result's ``extra``."""
        return {"transport": self.mode, "client_region": self.client_region, "spec_k": self.spec_k,
                "spec_acceptance": self.acceptance,
                "spec_expected_tokens_per_step": expected_tokens(self.acceptance, self.spec_k)}


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verify step of k drafts yields on average: 1 + a + ... + a^k."""
    a = acceptance
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def draw_accepted(rng: random.Random, acceptance: float, k: int) -> int:
    """Drafts accepted out of ``k``: each in turn with probability ``acceptance``, up to the first miss."""
    n = 0
    while n < k and rng.random() < acceptance:
        n += 1
    return n


def node_regions(topology: Topology, intra_max_s: float = 0.005) -> list[int]:
    """Each node's region: connected groups over node-to-node links of latency <= ``intra_max_s``
    (either direction), numbered in the order of their lowest node index."""
    parent = list(range(topology.num_nodes))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for link in topology.links:
        if link.src >= 0 and link.dst >= 0 and link.latency_s <= intra_max_s:
            a, b = root(link.src), root(link.dst)
            parent[max(a, b)] = min(a, b)
    numbers: dict[int, int] = {}
    return [numbers.setdefault(root(i), len(numbers)) for i in range(topology.num_nodes)]


def relocate_client(topology: Topology, region: int, intra_max_s: float = 0.005) -> Topology:
    """``topology`` with the source and sink moved to ``region``: the client's link to node v (and
    back) is the fastest existing link between v and another node of ``region``."""
    regions = node_regions(topology, intra_max_s)
    members = [i for i, r in enumerate(regions) if r == region]
    if not members:
        raise ConfigError(f"no region {region}: the cluster has {max(regions, default=-1) + 1}")
    kept = [l for l in topology.links if l.src != SOURCE_INDEX and l.dst != SINK_INDEX]
    out, back = [], []
    for v in range(topology.num_nodes):
        there = [l for l in topology.links if l.dst == v and l.src in members and l.src != v]
        home = [l for l in topology.links if l.src == v and l.dst in members and l.dst != v]
        if not there or not home:
            raise ConfigError(f"node {v} has no link to another node of region {region} to model the client's")
        best_in = min(there, key=lambda l: l.latency_s)
        best_out = min(home, key=lambda l: l.latency_s)
        out.append(LinkSpec(SOURCE_INDEX, v, best_in.bandwidth, best_in.latency_s))
        back.append(LinkSpec(v, SINK_INDEX, best_out.bandwidth, best_out.latency_s))
    return replace(topology, links=tuple(kept + out + back), missing_links=())


class ClientRelay:
    """Client-driven transport for a ``ClusterSim`` (``sim``): every stage's output returns to the
    client over the stage node's link to it, and the client sends it on to the next stage.

    The links are the simulation's own source/sink :class:`Link` objects where the routing graph
    has them (one FIFO per physical link), else new ones over the topology's client links.
    """

    def __init__(self, sim, at_sink: Callable[[list[Query]], None]) -> None:
        self.sim = sim
        self._at_sink = at_sink
        graph = sim.graph
        self.up: dict[int, Link] = {}
        self.down: dict[int, Link] = {}
        for v, node in sim.nodes.items():
            for key, table, deliver in (((SOURCE_INDEX, v), self.down, node.receive),
                                        ((v, SINK_INDEX), self.up, self._at_client)):
                link = sim.links.get(key)
                if link is None:
                    if graph.topology.link(*key) is None:
                        raise ConfigError(f"client-driven transport needs a client link {key} (node {v})")
                    link = Link(sim.loop, key[0], key[1], graph.bytes_per_s(*key), graph.latency(*key), deliver)
                    sim.links[key] = link
                link.deliver = deliver
                table[v] = link

    def node_exit(self, node: Node, jobs: list[Query]) -> None:
        """Jobs finished their stage on ``node``: all go back to the client in one message."""
        act, tok = self.sim.graph.activation_bytes, self.sim.graph.token_bytes
        nbytes = 0.0
        for j in jobs:
            j.hop += 1
            nbytes += act * j.tokens if j.hop < len(j.route) else tok * (1 if j.is_prompt else j.tokens)
        self.up[node.idx].send(jobs, nbytes)

    def _at_client(self, jobs: list[Query]) -> None:
        """At the client: finished jobs are tokens; the rest go on to their next stage."""
        done = [j for j in jobs if j.hop >= len(j.route)]
        by_dst: dict[int, list[Query]] = {}
        for j in jobs:
            if j.hop < len(j.route):
                by_dst.setdefault(j.route[j.hop].node, []).append(j)
        act = self.sim.graph.activation_bytes
        for dst, lst in by_dst.items():
            self.down[dst].send(lst, act * sum(j.tokens for j in lst))
        if done:
            self._at_sink(done)


def client_graph(graph: StageGraph, transport: TransportConfig) -> StageGraph:
    """``graph`` with the client moved to ``transport.client_region`` (itself when None). The
    scenario's flows and placement are kept: they were planned for the file's coordinator."""
    if transport.client_region is None:
        return graph
    from p2pserve.sim.graph import StageGraph

    topology = relocate_client(graph.topology, transport.client_region, transport.intra_max_s)
    return StageGraph.build(topology, graph.assignments)
