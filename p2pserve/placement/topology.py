"""An immutable snapshot of the swarm the planner works on: nodes, links, source/sink.

The snapshot is generic: plain lists of :class:`NodeSpec` and :class:`LinkSpec`. The control
plane builds it from live ``PeerInfo``/``LinkInfo`` records; ``p2pserve.helix.topology`` builds
it from a Helix cluster file. Node indices are ``0..n-1``; the source (clients) and the sink are
``SOURCE_INDEX`` / ``SINK_INDEX`` from :mod:`p2pserve.types`.

Bandwidth conventions (the :class:`BandwidthConvention` parameter):

* ``BYTES_PER_S`` -- the live swarm. ``LinkInfo`` carries *measured bytes per second*; capacity
  in tokens/s is ``bandwidth / bytes_per_activation`` (peer->peer) or ``bandwidth /
  bytes_per_token_id`` (source/sink). Physically correct.
* ``HELIX`` -- reproduction of the Helix artifact. Their files say ``1000 * mbps`` (nominally
  bits/s) and their code divides that number directly by sizes in bytes, so a "1 Gbps" link
  moves 1e9 / 16384 = 61,035 activations/s (8x what the wire could). We keep it to reproduce
  their MILP inputs and results; it is numerically identical to ``BYTES_PER_S`` applied to the
  file's number.
* ``BITS_PER_S`` -- read a Helix file's number as bits/s and divide by 8 (what a 1 Gbit/s link
  really carries). Use it to ask "what if their links were what the files say".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Sequence

from p2pserve.errors import ConfigError
from p2pserve.placement.profile import LatencyProfile
from p2pserve.types import SINK_INDEX, SOURCE_INDEX


class BandwidthConvention(str, Enum):
    """How a link's ``bandwidth`` number converts to bytes per second (see module docstring)."""

    BYTES_PER_S = "bytes_per_s"
    HELIX = "helix"
    BITS_PER_S = "bits_per_s"

    def bytes_per_s(self, bandwidth: float) -> float:
        """Bytes per second carried by a link whose announced/file number is ``bandwidth``."""
        return bandwidth / 8.0 if self is BandwidthConvention.BITS_PER_S else bandwidth


@dataclass(frozen=True)
class NodeSpec:
    """One compute node (a peer; a multi-GPU peer is one logical node).

    ``throughput[k]`` is tokens/s when holding ``k`` layers (index 0 unused, 0.0); its length is
    ``max_layers + 1``. ``kv_capacity[k]`` is the number of token-layer KV entries the node can
    hold with ``k`` layers loaded (0 = unknown). ``profile`` (optional) gives per-layer prompt and
    decode latency in ms for the latency/throughput estimate. ``decode_max_tokens[k]`` caps a
    decode batch (0 = no cap known), ``prompt_max_requests[k]`` a prompt batch (prompts per batch; empty:
    one).
    """

    name: str
    gpu_type: str
    throughput: tuple[float, ...]
    memory_bytes: float = 0.0
    kv_capacity: tuple[int, ...] = ()
    decode_max_tokens: tuple[int, ...] = ()
    profile: LatencyProfile | None = None
    prompt_max_requests: tuple[int, ...] = ()

    @property
    def max_layers(self) -> int:
        """Most layers this node can hold."""
        return len(self.throughput) - 1


@dataclass(frozen=True)
class LinkSpec:
    """A directed link ``src -> dst`` (node indices, or ``SOURCE_INDEX`` / ``SINK_INDEX``)."""

    src: int
    dst: int
    bandwidth: float  # raw number; converted by the topology's convention
    latency_s: float


@dataclass(frozen=True)
class Topology:
    """Immutable planner input: ``nodes`` (index = position), directed ``links``, model sizes.

    ``links`` must list both directions of an undirected link. Links from ``SOURCE_INDEX`` and to
    ``SINK_INDEX`` say which nodes clients can reach. ``missing_links`` names node pairs whose
    bandwidth was not measured and got a conservative default (flagged in plans).
    """

    nodes: tuple[NodeSpec, ...]
    links: tuple[LinkSpec, ...]
    num_layers: int
    activation_bytes: int
    token_bytes: int
    convention: BandwidthConvention = BandwidthConvention.BYTES_PER_S
    layer_bytes: float = 0.0
    model: str = ""
    name: str = ""
    missing_links: tuple[tuple[int, int], ...] = ()
    _index: dict = field(default=None, compare=False, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        index: dict[tuple[int, int], LinkSpec] = {}
        n = len(self.nodes)
        for link in self.links:
            for end in (link.src, link.dst):
                if not (end in (SOURCE_INDEX, SINK_INDEX) or 0 <= end < n):
                    raise ConfigError(f"link {link.src}->{link.dst} names an unknown node")
            index[(link.src, link.dst)] = link
        object.__setattr__(self, "_index", index)

    @property
    def num_nodes(self) -> int:
        """Number of compute nodes."""
        return len(self.nodes)

    def link(self, src: int, dst: int) -> LinkSpec | None:
        """The directed link ``src -> dst`` or None when the two cannot talk."""
        return self._index.get((src, dst))

    def capacity(self, src: int, dst: int) -> float:
        """Tokens/s the link ``src -> dst`` carries (0.0 when absent).

        Source->node and node->sink edges carry token ids (``token_bytes``); node->node edges
        carry activations (``activation_bytes``).
        """
        link = self._index.get((src, dst))
        if link is None:
            return 0.0
        size = self.token_bytes if (src == SOURCE_INDEX or dst == SINK_INDEX) else self.activation_bytes
        return self.convention.bytes_per_s(link.bandwidth) / size

    def bytes_per_s(self, src: int, dst: int) -> float:
        """Bytes per second the link ``src -> dst`` carries under the convention (0.0 when absent)."""
        link = self._index.get((src, dst))
        return 0.0 if link is None else self.convention.bytes_per_s(link.bandwidth)

    def latency(self, src: int, dst: int) -> float:
        """One-way latency in seconds of ``src -> dst`` (inf when absent)."""
        link = self._index.get((src, dst))
        return float("inf") if link is None else link.latency_s

    def upper_bound(self) -> float:
        """Helix §4.5 bound: sum_i max_k k*T_i(k) / L (tokens/s)."""
        total = 0.0
        for node in self.nodes:
            total += max((k * t for k, t in enumerate(node.throughput)), default=0.0)
        return total / self.num_layers

    def covering_upper_bound(self) -> float:
        """A tighter bound: the best sum_i k_i*T_i(k_i) / L over choices with sum_i k_i >= L.

        Every token passes every layer once, and node i can do at most k*T_i(k) layer-passes per
        second holding k layers; the coverage requirement forbids giving every node its best k.
        Solved exactly by a small knapsack DP over total layers (capped at L).
        """
        L = self.num_layers
        neg = float("-inf")
        best = [neg] * (L + 1)
        best[0] = 0.0
        for node in self.nodes:
            nxt = list(best)  # k = 0: node unused
            for have in range(L + 1):
                if best[have] == neg:
                    continue
                for k in range(1, node.max_layers + 1):
                    tgt = min(L, have + k)
                    val = best[have] + k * node.throughput[k]
                    if val > nxt[tgt]:
                        nxt[tgt] = val
            best = nxt
        if best[L] == neg:
            return 0.0
        return best[L] / L

    def without(self, removed: Sequence[int]) -> tuple["Topology", list[int]]:
        """A topology with nodes ``removed`` dropped; also returns old index of each new node."""
        gone = set(removed)
        keep = [i for i in range(self.num_nodes) if i not in gone]
        return self.subset(keep), keep

    def subset(self, keep: Sequence[int]) -> "Topology":
        """A topology over nodes ``keep`` (in that order), links remapped."""
        new_index = {old: new for new, old in enumerate(keep)}
        new_index[SOURCE_INDEX] = SOURCE_INDEX
        new_index[SINK_INDEX] = SINK_INDEX
        links = tuple(
            LinkSpec(new_index[l.src], new_index[l.dst], l.bandwidth, l.latency_s)
            for l in self.links
            if l.src in new_index and l.dst in new_index
        )
        return Topology(
            nodes=tuple(self.nodes[i] for i in keep),
            links=links,
            num_layers=self.num_layers,
            activation_bytes=self.activation_bytes,
            token_bytes=self.token_bytes,
            convention=self.convention,
            layer_bytes=self.layer_bytes,
            model=self.model,
            name=self.name,
        )

    def total_memory_layers(self) -> int:
        """How many layers all nodes together can hold."""
        return sum(n.max_layers for n in self.nodes)
