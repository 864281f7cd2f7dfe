"""``MachineInfo``: what a machine agent offers -- its GPUs and the measured links between them.

A multi-GPU machine announces the GPUs it offers (device name, memory) and, per GPU pair, the
measured all-reduce bus bandwidth and per-collective latency (NVLink or PCIe). The coordinator's
placement chooses how to group them into tensor-parallel peers (``placement/grouping.py``); each
group then serves as one peer announcing ``PeerInfo.tp``. Decoded like every record
(:func:`p2pserve.dht.records.decode_record`: msgspec types, then :meth:`MachineInfo.validate`).
"""

from __future__ import annotations

from typing import Optional

import msgspec

from p2pserve.dht.records import (
    MAX_BANDWIDTH_BYTES_S,
    MAX_LAYERS,
    MAX_TOKENS_PER_S,
    MAX_TP,
    MAX_MACHINE_SLOTS,
    MAX_MEMORY_BYTES,
    MAX_RTT_S,
    SCHEMA_VERSION,
    _check_schema,
    _finite,
    _int,
    _str,
)
from p2pserve.errors import RecordRejected
from p2pserve.types import PeerId

MAX_MACHINE_GPUS = MAX_MACHINE_SLOTS
GPU_LINK_KINDS: tuple[str, ...] = ("nvlink", "pcie", "other")


class GpuOffer(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """One GPU a machine agent offers: device name, memory in bytes and, when profiled, the
    slot's decode throughput holding k = 1, 2, ... layers (``PeerInfo.throughput_decode``'s form:
    what the coordinator's grouping estimate starts from)."""

    device: str
    memory_bytes: int
    throughput_decode: list[float] = []


class GpuLink(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """A measured link between GPUs ``a`` and ``b`` (indices into ``MachineInfo.gpus``):
    all-reduce bus bandwidth in bytes/s, per-collective latency in seconds, and its kind."""

    a: int
    b: int
    bandwidth: float
    latency_s: float
    kind: str = "other"


class MachineGroup(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """A TP group the agent runs now: its slots (indices into ``MachineInfo.gpus``) and the
    peer id it serves as (so the coordinator knows which peers a regrouping replaces)."""

    slots: list[int]
    peer_id: PeerId


class MachineInfo(msgspec.Struct, kw_only=True, frozen=True):
    """What a machine agent announces: the GPUs it offers and the measured links between them
    (the placement chooses how to group them into TP peers; placement/grouping.py)."""

    schema: int = SCHEMA_VERSION
    model: str
    machine_id: str  # libp2p peer id of the agent
    gpus: list[GpuOffer] = []
    links: list[GpuLink] = []
    groups: list[MachineGroup] = []
    tp_degrees: list[int] = []  # TP degrees > 1 the model splits into (heads, KV heads, MLP width); 1 always
    timestamp: float = 0.0

    def validate(self) -> None:
        """Raise :class:`RecordRejected` on too many GPUs, absurd memory or link figures, a link
        naming an unknown GPU or itself, or a pair measured twice."""
        _check_schema(self.schema)
        _str("model", self.model)
        _str("machine_id", self.machine_id)
        n = len(self.gpus)
        _int("gpus", n, 1, MAX_MACHINE_GPUS)
        for i, g in enumerate(self.gpus):
            _str(f"gpus[{i}].device", g.device)
            _int(f"gpus[{i}].memory_bytes", g.memory_bytes, 1, MAX_MEMORY_BYTES)
            if len(g.throughput_decode) > MAX_LAYERS:
                raise RecordRejected(f"gpus[{i}]: a profile of {len(g.throughput_decode)} layers")
            for k, t in enumerate(g.throughput_decode):
                _finite(f"gpus[{i}].throughput_decode[{k}]", t, 0.0, MAX_TOKENS_PER_S)
        if len(self.links) > n * (n - 1) // 2:
            raise RecordRejected(f"{len(self.links)} links among {n} GPUs")
        seen: set[tuple[int, int]] = set()
        for link in self.links:
            _int("link end", link.a, 0, n - 1)
            _int("link end", link.b, 0, n - 1)
            pair = (min(link.a, link.b), max(link.a, link.b))
            if link.a == link.b or pair in seen:
                raise RecordRejected(f"link {link.a}-{link.b} is a self-link or measured twice")
            seen.add(pair)
            _finite(f"bandwidth {pair}", link.bandwidth, 1.0, MAX_BANDWIDTH_BYTES_S)
            _finite(f"latency {pair}", link.latency_s, 0.0, MAX_RTT_S)
            if link.kind not in GPU_LINK_KINDS:
                raise RecordRejected(f"link kind {link.kind[:32]!r} not one of {GPU_LINK_KINDS}")
        self._validate_groups(n)
        if len(self.tp_degrees) > 4 or any(d not in (1, 2, 4, 8) or d > n for d in self.tp_degrees):
            raise RecordRejected(f"TP degrees {self.tp_degrees[:5]} are not powers of two up to {n}")
        _finite("timestamp", self.timestamp, 0.0, 1e11)

    def _validate_groups(self, n: int) -> None:
        """Groups name known, distinct slots, at most ``MAX_TP`` each, and a peer id each."""
        used: set[int] = set()
        if len(self.groups) > n:
            raise RecordRejected(f"{len(self.groups)} groups over {n} slots")
        for g in self.groups:
            _str("group peer id", g.peer_id)
            _int("group size", len(g.slots), 1, MAX_TP)
            for s in g.slots:
                _int("group slot", s, 0, n - 1)
                if s in used:
                    raise RecordRejected(f"slot {s} is in two groups")
                used.add(s)

    def bottleneck(self, gpus: list[int]) -> Optional[tuple[float, float]]:
        """(lowest bandwidth, highest latency) over every pair of ``gpus``; None when some pair
        was not measured (the planner then keeps those GPUs apart)."""
        by_pair = {(min(l.a, l.b), max(l.a, l.b)): l for l in self.links}
        bw, lat = float("inf"), 0.0
        for i, a in enumerate(gpus):
            for b in gpus[i + 1:]:
                link = by_pair.get((min(a, b), max(a, b)))
                if link is None:
                    return None
                bw, lat = min(bw, link.bandwidth), max(lat, link.latency_s)
        return bw, lat
