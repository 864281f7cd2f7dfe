"""A plan for thousands of peers as DHT records of bounded size, with deltas between epochs.

One :class:`~p2pserve.dht.records.Plan` of a thousand peers carries every target, span and
flow; every reader (each peer, each client) would fetch all of it every round, and it grows
past what one DHT value should hold. Here a plan is published as:

* one :class:`PlanIndex`: the epoch, the plan's figures, and a :class:`ChunkRef` per chunk (its
  name, the epoch its content was made in, a digest of that content, its peers' count, the flow
  it takes from clients and its size);
* one :class:`PlanChunk` per group of peers (a region, or a part of one when a region's chunk
  would pass ``limit`` bytes): the group's targets and spans and the flows leaving its peers
  (flows from the source go with the peer they enter).

**Deltas**: a chunk whose content did not change since the last epoch keeps its old
``ChunkRef`` (old epoch, same digest), so a new epoch republishes only the chunks that changed
(:func:`delta`), and a reader refetches only those. **Clients** read the index, then only the
chunks of one group (:func:`route_chunks`): a group's flows stay inside it, so they hold a whole
route. Every record is typed and validated like the other records (untrusted input); the
digest check in :func:`assemble` ties each chunk to the index that names it.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Mapping, Optional, Sequence

import msgspec

from p2pserve.dht.records import (
    MAX_EPOCH, MAX_FLOWS, MAX_LAYERS, MAX_PEERS_IN_PLAN, MAX_STR, MAX_TOKENS_PER_S, SCHEMA_VERSION, Flow, Plan,
    check_span,
)
from p2pserve.errors import MalformedFrameError, RecordRejected
from p2pserve.types import SINK, SOURCE, LayerRange

#: Most bytes of one chunk record. A hivemind DHT process reads each call from its pipe without
#: blocking, and ``multiprocessing`` writes a message over 16 KiB as two sends (header, then
#: body): a store of a larger value can arrive half-written and kill the DHT process
#: (``BlockingIOError`` in ``DHT._run``; seen storing a 40-peer Plan of 44 kB and a 32 KiB chunk).
#: 12 KiB leaves room for the call's key, owner subkey and pickling within 16 KiB.
CHUNK_LIMIT_BYTES = 12 << 10
MAX_CHUNKS = 4096
DIGEST_BYTES = 16
#: Defaulted links the index names (the plan's list can grow with the square of the peers; the
#: index carries the first ones, which is what ``p2pserve status`` shows).
MAX_DEFAULTED_IN_INDEX = 32


class ChunkRef(msgspec.Struct, frozen=True, array_like=True):
    """One chunk as the index names it."""

    name: str
    epoch: int
    digest: bytes
    peers: int
    flow: float
    size: int


class PlanIndex(msgspec.Struct, kw_only=True, frozen=True):
    """The plan's header and the list of its chunks (see module docstring)."""

    schema: int = SCHEMA_VERSION
    model: str
    epoch: int
    leader_id: str
    num_layers: int
    chunks: list[ChunkRef] = []
    max_flow: float = 0.0
    upper_bound: float = 0.0
    solve_time: float = 0.0
    created_at: float = 0.0
    reason: str = ""
    # machine agents' groupings (``Plan.groupings``) and the first defaulted links
    groupings: dict[str, list[int]] = {}
    defaulted_links: list[tuple[str, str]] = []
    # the chunks' groups are the plan's cells (``Plan.cells``): readers get them back from the names
    cells: bool = False

    def validate(self) -> None:
        """Raise :class:`RecordRejected` on malformed figures, names, digests or sizes."""
        _check_common(self.schema, self.model, self.epoch, self.num_layers)
        _bounded_str("leader_id", self.leader_id)
        if len(self.reason) > 4 * MAX_STR:
            raise RecordRejected("reason too long")
        if len(self.groupings) > MAX_PEERS_IN_PLAN or len(self.defaulted_links) > MAX_DEFAULTED_IN_INDEX:
            raise RecordRejected("too many groupings or defaulted links in plan index")
        if len(self.chunks) > MAX_CHUNKS:
            raise RecordRejected(f"{len(self.chunks)} chunks, at most {MAX_CHUNKS}")
        names = set()
        for ref in self.chunks:
            _bounded_str("chunk name", ref.name)
            if ref.name in names:
                raise RecordRejected(f"chunk {ref.name!r} listed twice")
            names.add(ref.name)
            if not 0 <= ref.epoch <= self.epoch:
                raise RecordRejected(f"chunk {ref.name!r} from epoch {ref.epoch}, after the plan's {self.epoch}")
            if len(ref.digest) != DIGEST_BYTES:
                raise RecordRejected(f"chunk {ref.name!r}: digest of {len(ref.digest)} bytes")
            if not 0 <= ref.peers <= MAX_PEERS_IN_PLAN or not 0 < ref.size <= CHUNK_LIMIT_BYTES:
                raise RecordRejected(f"chunk {ref.name!r}: {ref.peers} peers, {ref.size} bytes")
            _finite(f"flow of chunk {ref.name!r}", ref.flow, MAX_TOKENS_PER_S * MAX_LAYERS)
        for name, x in (("max_flow", self.max_flow), ("upper_bound", self.upper_bound),
                        ("solve_time", self.solve_time), ("created_at", self.created_at)):
            _finite(name, x, 1e12)


class PlanChunk(msgspec.Struct, kw_only=True, frozen=True):
    """One group's part of a plan: targets, spans and the flows leaving its peers."""

    schema: int = SCHEMA_VERSION
    model: str
    epoch: int
    name: str
    num_layers: int
    targets: dict[str, LayerRange] = {}
    spans: dict[str, LayerRange] = {}
    flows: list[Flow] = []

    def validate(self) -> None:
        """Raise :class:`RecordRejected` on bad ranges, flows leaving other chunks' peers, sizes."""
        _check_common(self.schema, self.model, self.epoch, self.num_layers)
        _bounded_str("chunk name", self.name)
        if len(self.targets) > MAX_PEERS_IN_PLAN or len(self.spans) > MAX_PEERS_IN_PLAN:
            raise RecordRejected("too many peers in chunk")
        if len(self.flows) > MAX_FLOWS:
            raise RecordRejected("too many flows in chunk")
        for peer, span in self.targets.items():
            _bounded_str("peer id", peer)
            check_span(f"target of {peer}", span, self.num_layers)
        for peer, span in self.spans.items():
            _bounded_str("peer id", peer)
            check_span(f"span of {peer}", span, self.num_layers)
        for f in self.flows:
            _finite(f"flow {f.src}->{f.dst}", f.rate, MAX_TOKENS_PER_S * MAX_LAYERS)
            if f.src != SOURCE and f.src not in self.spans:
                raise RecordRejected(f"flow {f.src}->{f.dst} leaves a peer this chunk does not hold")
            if f.src == SOURCE and f.dst not in self.spans:
                raise RecordRejected(f"flow from the source enters {f.dst}, not in this chunk")


def _check_common(schema: int, model: str, epoch: int, num_layers: int) -> None:
    if schema != SCHEMA_VERSION:
        raise RecordRejected(f"schema {schema} not supported (this build reads {SCHEMA_VERSION})")
    _bounded_str("model", model)
    if not 0 <= epoch <= MAX_EPOCH:
        raise RecordRejected(f"epoch={epoch} outside [0, {MAX_EPOCH}]")
    if not 1 <= num_layers <= MAX_LAYERS:
        raise RecordRejected(f"num_layers={num_layers} outside [1, {MAX_LAYERS}]")


def _bounded_str(name: str, s: str) -> None:
    if not s or len(s) > MAX_STR:
        raise RecordRejected(f"{name} must be 1-{MAX_STR} characters, got {len(s)}")


def _finite(name: str, x: float, hi: float) -> None:
    if not (0.0 <= x <= hi):  # False for NaN as well
        raise RecordRejected(f"{name}={x!r} outside [0, {hi:g}]")


_ENCODER = msgspec.msgpack.Encoder()
_INDEX = msgspec.msgpack.Decoder(PlanIndex)
_CHUNK = msgspec.msgpack.Decoder(PlanChunk)


def encode(record: PlanIndex | PlanChunk) -> bytes:
    """MessagePack bytes of an index or a chunk."""
    return _ENCODER.encode(record)


def decode_index(data: bytes) -> PlanIndex:
    """Decode and validate untrusted bytes as a :class:`PlanIndex`."""
    return _decode(data, _INDEX, 4 * CHUNK_LIMIT_BYTES + MAX_CHUNKS * 128)


def decode_chunk(data: bytes) -> PlanChunk:
    """Decode and validate untrusted bytes as a :class:`PlanChunk`."""
    return _decode(data, _CHUNK, CHUNK_LIMIT_BYTES)


def _decode(data: bytes, dec: msgspec.msgpack.Decoder, limit: int) -> Any:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedFrameError(f"expected bytes, got {type(data).__name__}")
    if len(data) > limit:
        raise MalformedFrameError(f"record of {len(data)} bytes exceeds {limit}")
    try:
        record = dec.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise MalformedFrameError(f"not a valid plan record: {e}") from e
    record.validate()
    return record


def content_digest(chunk: PlanChunk) -> bytes:
    """Digest of a chunk's content, its epoch left out (an unchanged chunk keeps its digest)."""
    return hashlib.blake2b(encode(msgspec.structs.replace(chunk, epoch=0)), digest_size=DIGEST_BYTES).digest()


def split_plan(plan: Plan, group_of: Mapping[str, str],
               limit: int = CHUNK_LIMIT_BYTES) -> tuple[PlanIndex, list[PlanChunk]]:
    """``plan`` as an index and chunks of at most ``limit`` bytes; ``group_of`` names each peer's
    group (peers it does not name go to group ``"rest"``). A group too large for one chunk is cut
    into parts ``group.0``, ``group.1``, ... by peer id. A plan with cells is grouped by them
    (``group_of`` is then not used)."""
    if plan.cells:
        group_of = plan.cells
    groups: dict[str, list[str]] = {}
    for peer in sorted(set(plan.targets) | set(plan.spans)):
        groups.setdefault(group_of.get(peer, "rest"), []).append(peer)
    chunks: list[PlanChunk] = []
    for g in sorted(groups):
        chunks.extend(_fit(plan, g, groups[g], limit))
    refs = [_ref(c, plan.epoch) for c in chunks]
    index = PlanIndex(model=plan.model, epoch=plan.epoch, leader_id=plan.leader_id, num_layers=plan.num_layers,
                      chunks=refs, max_flow=plan.max_flow, upper_bound=plan.upper_bound, solve_time=plan.solve_time,
                      created_at=plan.created_at, reason=plan.reason[:4 * MAX_STR], groupings=dict(plan.groupings),
                      defaulted_links=list(plan.defaulted_links[:MAX_DEFAULTED_IN_INDEX]), cells=bool(plan.cells))
    return index, chunks


def flow_groups(plan: Plan) -> dict[str, str]:
    """Peer id -> group name: the connected parts of the plan's flow graph between peers (the
    source and sink left out), so that a group's chunks hold whole routes. Named ``g0``, ``g1``,
    ... in the order of their lowest peer id; peers without flows go to ``idle``."""
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for f in plan.flows:
        for end in (f.src, f.dst):
            if end not in (SOURCE, SINK):
                parent.setdefault(end, end)
        if f.src not in (SOURCE, SINK) and f.dst not in (SOURCE, SINK):
            a, b = root(f.src), root(f.dst)
            if a != b:
                parent[max(a, b)] = min(a, b)
    members: dict[str, list[str]] = {}
    for peer in parent:
        members.setdefault(root(peer), []).append(peer)
    names = {r: f"g{x}" for x, r in enumerate(sorted(members, key=lambda r: min(members[r])))}
    out = {peer: names[root(peer)] for peer in parent}
    return {peer: out.get(peer, "idle") for peer in sorted(set(plan.targets) | set(plan.spans) | set(out))}


def _fit(plan: Plan, group: str, peers: Sequence[str], limit: int) -> list[PlanChunk]:
    """The group's chunk, or its parts, each within ``limit`` bytes."""
    parts = 1
    while True:
        cut = [list(peers[x::parts]) for x in range(parts)] if parts > 1 else [list(peers)]
        names = [group] if parts == 1 else [f"{group}.{x}" for x in range(parts)]
        chunks = [_chunk(plan, n, members) for n, members in zip(names, cut)]
        if all(len(encode(c)) <= limit for c in chunks) or parts >= len(peers):
            if any(len(encode(c)) > limit for c in chunks):
                raise RecordRejected(f"one peer's part of the plan exceeds {limit} bytes")
            return chunks
        parts *= 2


def _chunk(plan: Plan, name: str, peers: Iterable[str]) -> PlanChunk:
    mine = set(peers)
    flows = [f for f in plan.flows if f.src in mine or (f.src == SOURCE and f.dst in mine)]
    return PlanChunk(model=plan.model, epoch=plan.epoch, name=name, num_layers=plan.num_layers,
                     targets={p: s for p, s in plan.targets.items() if p in mine},
                     spans={p: s for p, s in plan.spans.items() if p in mine}, flows=flows)


def _ref(chunk: PlanChunk, epoch: int) -> ChunkRef:
    flow = sum(f.rate for f in chunk.flows if f.src == SOURCE)
    return ChunkRef(chunk.name, epoch, content_digest(chunk), len(set(chunk.targets) | set(chunk.spans)), flow,
                    len(encode(chunk)))


def delta(previous: Optional[PlanIndex], index: PlanIndex,
          chunks: Sequence[PlanChunk]) -> tuple[PlanIndex, list[PlanChunk]]:
    """The index to publish and the chunks that must be stored: a chunk whose content equals the
    previous epoch's chunk of the same name keeps that chunk's reference (and is not stored
    again); the others are stored under the new epoch."""
    old = {r.name: r for r in previous.chunks} if previous is not None else {}
    refs: list[ChunkRef] = []
    fresh: list[PlanChunk] = []
    for ref, chunk in zip(index.chunks, chunks):
        prev = old.get(ref.name)
        if prev is not None and prev.digest == ref.digest:
            refs.append(prev)
        else:
            refs.append(ref)
            fresh.append(chunk)
    return msgspec.structs.replace(index, chunks=refs), fresh


def group_name(chunk: str) -> str:
    """The group a chunk belongs to (``r0.1`` is part 1 of group ``r0``)."""
    return chunk.rsplit(".", 1)[0] if "." in chunk else chunk


def route_chunks(index: PlanIndex, group: Optional[str] = None) -> list[str]:
    """The chunks a client reads for a route: those of ``group`` (all its parts) when the index
    has it, else those of the group that takes the most flow from clients."""
    by_group: dict[str, list[ChunkRef]] = {}
    for ref in index.chunks:
        by_group.setdefault(group_name(ref.name), []).append(ref)
    if not by_group:
        return []
    if group not in by_group:
        group = max(sorted(by_group), key=lambda g: sum(r.flow for r in by_group[g]))
    return [r.name for r in by_group[group]]


def assemble(index: PlanIndex, chunks: Mapping[str, PlanChunk]) -> Plan:
    """The plan from its index and the chunks it names (each checked against its reference);
    chunks not given are left out (a client that read one group gets that group's plan)."""
    targets: dict[str, LayerRange] = {}
    spans: dict[str, LayerRange] = {}
    flows: list[Flow] = []
    cells: dict[str, str] = {}
    for ref in index.chunks:
        chunk = chunks.get(ref.name)
        if chunk is None:
            continue
        if chunk.name != ref.name or chunk.epoch != ref.epoch or content_digest(chunk) != ref.digest:
            raise RecordRejected(f"chunk {ref.name!r} does not match the index (epoch {ref.epoch})")
        if chunk.model != index.model or chunk.num_layers != index.num_layers:
            raise RecordRejected(f"chunk {ref.name!r} is for another model")
        targets.update(chunk.targets)
        spans.update(chunk.spans)
        if index.cells:
            cells.update((peer, group_name(ref.name)) for peer in (*chunk.targets, *chunk.spans))
        flows.extend(chunk.flows)
    plan = Plan(model=index.model, epoch=index.epoch, leader_id=index.leader_id, num_layers=index.num_layers,
                targets=targets, spans=spans, flows=[f for f in flows if f.dst in spans or f.dst == SINK],
                max_flow=index.max_flow, upper_bound=index.upper_bound, solve_time=index.solve_time,
                created_at=index.created_at, reason=index.reason, groupings=dict(index.groupings),
                defaulted_links=list(index.defaulted_links), cells=cells)
    plan.validate()
    return plan
