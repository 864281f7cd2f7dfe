"""Typed DHT records: ``PeerInfo``, ``LinkInfo``, ``CoordinatorCandidate``, ``Plan`` (and
``MachineInfo`` in :mod:`p2pserve.dht.machine_info`).

Records are ``msgspec.Struct``s encoded as MessagePack (never pickle). Decoding untrusted bytes
goes through :func:`decode_record`, which checks field types (msgspec) and then the record's own
``validate()``, which rejects absurd figures with a human-readable reason. Nothing here does I/O.

Every record carries a ``schema`` version. A reader accepts only ``schema == SCHEMA_VERSION``
for now; a later version bump must keep readers of the old one working for a release.

Layer ranges are half-open ``(start, end)`` pairs, i.e. layers ``start .. end-1``.
"""

from __future__ import annotations

from typing import Optional, TypeVar, Union

import msgspec

from p2pserve.dht.bounds import (  # noqa: F401  (re-exported: readers import the bounds from here)
    SCHEMA_VERSION,
    MAX_LAYERS,
    MAX_ACTIVATION_BYTES,
    MAX_MEMORY_BYTES,
    MAX_TOKENS_PER_S,
    MAX_BANDWIDTH_BYTES_S,
    MAX_RTT_S,
    MAX_TOKENS,
    MAX_EPOCH,
    MAX_ADDRS,
    MAX_STR,
    MAX_QUANT,
    MAX_LINKS,
    MAX_PEERS_IN_PLAN,
    MAX_FLOWS,
    MAX_TP,
    MAX_MACHINE_SLOTS,
    MAX_LATENCY_POINTS,
    MAX_LAYER_MS,
    MAX_KV_ENTRY_BYTES,
    PeerState,
    PEER_STATES,
    _finite,
    _int,
    _str,
    check_span,
    _check_quant,
    _check_schema,
)
from p2pserve.dht.evidence import check_reply_key
from p2pserve.errors import MalformedFrameError, RecordRejected
from p2pserve.types import SINK, SOURCE, LayerRange, PeerId

# ---------------------------------------------------------------------------------------------


class LatencyPoints(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """Measured ms for ONE layer against a batch's prompt / decode tokens, ``(tokens, ms)`` points,
    tokens increasing: what the publish guard simulates (as ``placement.profile.LatencyProfile``)."""

    prompt: list[tuple[float, float]] = []
    decode: list[tuple[float, float]] = []

    def validate(self) -> None:
        """Raise :class:`RecordRejected` unless both phases hold 1-8 sane, increasing points."""
        for name, points in (("prompt", self.prompt), ("decode", self.decode)):
            if not 1 <= len(points) <= MAX_LATENCY_POINTS:
                raise RecordRejected(f"latency {name}: {len(points)} points, 1-{MAX_LATENCY_POINTS} allowed")
            for tokens, ms in points:
                _finite(f"latency {name} tokens", tokens, 1.0, float(MAX_TOKENS))
                _finite(f"latency {name} ms", ms, 1e-6, MAX_LAYER_MS)
            if any(b[0] <= a[0] for a, b in zip(points, points[1:])):
                raise RecordRejected(f"latency {name}: token counts must increase")


class PeerInfo(msgspec.Struct, kw_only=True, frozen=True):
    """What a peer announces about itself (refreshed every few seconds).

    ``throughput_decode[j-1]`` / ``throughput_prefill[j-1]`` are tokens/s when the peer holds
    ``j`` layers (Helix's T[j]); both tables have ``max_layers`` entries or are empty while the
    peer has not profiled yet.
    """

    schema: int = SCHEMA_VERSION
    model: str
    peer_id: PeerId  # libp2p peer id (base58) of the peer's DHT/P2P node
    addrs: list[str] = []
    device: str = "unknown"
    weights_memory_bytes: int = 0
    kv_memory_bytes: int = 0
    dtype: str = "float16"
    throughput_decode: list[float] = []
    throughput_prefill: list[float] = []
    max_layers: int = 0
    serving: Optional[LayerRange] = None
    loading: Optional[LayerRange] = None
    loaded: bool = False  # ``loading`` is in memory; the peer flips once its dropped layers are covered
    state: PeerState = "joining"
    kv_free_tokens: int = 0
    queued_tokens: int = 0
    version: str = ""
    relayed: bool = False
    timestamp: float = 0.0  # DHT time of this announcement
    # hex Ed25519 public key that signs this peer's ForwardResults ("" = none); derived from the
    # identity key that signs this record (p2pserve.dht.evidence.derive_reply_key)
    reply_key: str = ""
    # The model's shape as the peer's checkpoint gives it (0: not announced, as by older peers).
    # A coordinator that knows the model only by name plans with the shape its peers agree on
    # (coordinator/shape.py); a reader that knows the depth drops a peer announcing another.
    num_layers: int = 0
    activation_bytes: int = 0  # bytes of one token's hidden state on the wire (hidden size x dtype bytes)
    # Weight-only quantization of the layers served ("" = full width; model/quant.py): part of the
    # model's identity, so it must match the model name's "@SCHEME" suffix; clients route only
    # over peers announcing the quantization they asked for (client/swarm_routes.py).
    quant: str = ""
    # Tensor-parallel degree: the peer is a TP group of this many GPUs of one machine (its
    # throughput tables are the group's); 1 for a single-GPU peer and for older peers.
    tp: int = 1
    # Per-layer latency (None: older peers) and one token-layer KV entry's bytes (0: unknown): with
    # ``kv_memory_bytes``, what a coordinator needs to simulate the swarm before publishing a plan.
    latency: Optional[LatencyPoints] = None
    kv_entry_bytes: int = 0
    model_id: str = ""  # its sessions' model id (ModelSpec.model_id; a --swarm-model name differs; "": older peers)

    def validate(self, num_layers: Optional[int] = None) -> None:
        """Raise :class:`RecordRejected` if any figure is absurd or inconsistent (with the
        model's ``num_layers`` when the reader knows it, else with the depth the peer announces)."""
        _check_schema(self.schema)
        _int("num_layers", self.num_layers, 0, MAX_LAYERS)
        _int("activation_bytes", self.activation_bytes, 0, MAX_ACTIVATION_BYTES)
        if num_layers is not None and self.num_layers and self.num_layers != num_layers:
            raise RecordRejected(f"announces a model of {self.num_layers} layers; this model has {num_layers}")
        num_layers = num_layers if num_layers is not None else (self.num_layers or None)
        _str("model", self.model)
        _str("peer_id", self.peer_id)
        if len(self.addrs) > MAX_ADDRS:
            raise RecordRejected(f"{len(self.addrs)} addrs, at most {MAX_ADDRS}")
        for a in self.addrs:
            _str("addr", a)
        _str("device", self.device)
        _str("dtype", self.dtype)
        for name in ("version", "model_id"):
            _str(name, getattr(self, name), allow_empty=True)
        _int("weights_memory_bytes", self.weights_memory_bytes, 0, MAX_MEMORY_BYTES)
        _int("kv_memory_bytes", self.kv_memory_bytes, 0, MAX_MEMORY_BYTES)
        _int("max_layers", self.max_layers, 0, MAX_LAYERS if num_layers is None else num_layers)
        for name, table in (("throughput_decode", self.throughput_decode), ("throughput_prefill", self.throughput_prefill)):
            if table and len(table) != self.max_layers:
                raise RecordRejected(f"{name} has {len(table)} entries but max_layers={self.max_layers}")
            for j, t in enumerate(table, start=1):
                _finite(f"{name}[{j}]", t, 0.0, MAX_TOKENS_PER_S)
        check_span("serving", self.serving, num_layers)
        check_span("loading", self.loading, num_layers)
        for name, span in (("serving", self.serving), ("loading", self.loading)):
            if span is not None and self.max_layers and span[1] - span[0] > self.max_layers:
                raise RecordRejected(f"{name} holds {span[1] - span[0]} layers but max_layers={self.max_layers}")
        if self.state == "serving" and self.serving is None:
            raise RecordRejected("state=serving without a serving range")
        if self.state == "loading" and self.loading is None:
            raise RecordRejected("state=loading without a loading range")
        _int("kv_free_tokens", self.kv_free_tokens, 0, MAX_TOKENS)
        _int("queued_tokens", self.queued_tokens, 0, MAX_TOKENS)
        _finite("timestamp", self.timestamp, 0.0, 1e11)
        check_reply_key(self.reply_key)
        _check_quant(self.quant, self.model)
        _int("tp", self.tp, 1, MAX_TP)
        _int("kv_entry_bytes", self.kv_entry_bytes, 0, MAX_KV_ENTRY_BYTES)
        if self.latency is not None:
            self.latency.validate()

    def kv_capacity(self) -> int:
        """Token-layer KV entries the peer's KV memory holds (0 if it does not say)."""
        return self.kv_memory_bytes // self.kv_entry_bytes if self.kv_entry_bytes else 0

    def decode_rate(self, n_layers: int) -> float:
        """Decode tokens/s when holding ``n_layers`` layers (0 if unknown)."""
        if 1 <= n_layers <= len(self.throughput_decode):
            return self.throughput_decode[n_layers - 1]
        return 0.0


class LinkStat(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """One measured link: bandwidth in bytes/s, round-trip time in seconds, when measured."""

    bandwidth: float
    rtt: float
    measured_at: float = 0.0


class LinkInfo(msgspec.Struct, kw_only=True, frozen=True):
    """Links measured by ``peer_id`` to other peers (refreshed less often than PeerInfo)."""

    schema: int = SCHEMA_VERSION
    model: str
    peer_id: PeerId
    links: dict[str, LinkStat] = {}
    timestamp: float = 0.0

    def validate(self) -> None:
        """Raise :class:`RecordRejected` on absurd bandwidth / RTT or too many entries."""
        _check_schema(self.schema)
        _str("model", self.model)
        _str("peer_id", self.peer_id)
        if len(self.links) > MAX_LINKS:
            raise RecordRejected(f"{len(self.links)} links, at most {MAX_LINKS}")
        for other, stat in self.links.items():
            _str("link peer id", other)
            if other == self.peer_id:
                raise RecordRejected("a link to itself")
            _finite(f"bandwidth to {other}", stat.bandwidth, 0.0, MAX_BANDWIDTH_BYTES_S)
            _finite(f"rtt to {other}", stat.rtt, 0.0, MAX_RTT_S)
            _finite(f"measured_at for {other}", stat.measured_at, 0.0, 1e11)
        _finite("timestamp", self.timestamp, 0.0, 1e11)


class CoordinatorCandidate(msgspec.Struct, kw_only=True, frozen=True):
    """An election candidate. ``public_key`` must be the key that signed the record."""

    schema: int = SCHEMA_VERSION
    model: str
    coordinator_id: str
    priority: int = 0
    start_time: float
    public_key: str  # OpenSSH text ("ssh-rsa AAAA...")

    def validate(self) -> None:
        """Raise :class:`RecordRejected` on malformed fields."""
        _check_schema(self.schema)
        _str("model", self.model)
        _str("coordinator_id", self.coordinator_id)
        _int("priority", self.priority, -(1 << 31), (1 << 31) - 1)
        _finite("start_time", self.start_time, 0.0, 1e11)
        if not self.public_key or len(self.public_key) > 4096:
            raise RecordRejected("public_key missing or too long")


class Flow(msgspec.Struct, frozen=True, array_like=True):
    """Tokens/s routed from ``src`` to ``dst`` (peer ids, or ``"source"`` / ``"sink"``)."""

    src: str
    dst: str
    rate: float


class Plan(msgspec.Struct, kw_only=True, frozen=True):
    """A placement and routing plan published by the elected coordinator.

    ``targets`` is where each peer *should* be (it loads, then flips); ``spans`` is what each
    peer *serves now* and the graph ``flows`` were computed over, so a client following
    ``flows`` never reaches a range that is not loaded.
    """

    schema: int = SCHEMA_VERSION
    model: str
    epoch: int
    leader_id: str
    num_layers: int
    targets: dict[str, LayerRange] = {}
    spans: dict[str, LayerRange] = {}
    flows: list[Flow] = []
    max_flow: float = 0.0
    upper_bound: float = 0.0
    solve_time: float = 0.0
    defaulted_links: list[tuple[str, str]] = []
    created_at: float = 0.0
    reason: str = ""
    # machine agents' groupings: machine id -> TP degrees of its groups, in slot order
    # ([2, 1, 1]: slots 0-1 as one TP-2 peer, slots 2 and 3 alone; coordinator/groupings.py)
    groupings: dict[str, list[int]] = {}
    # peer id -> the cell it was planned in (placement/scale.py), so that a re-plan after peers
    # leave repairs only the cells that lost them; on the DHT these are the chunks' names
    # (dht/plan_chunks.py), so they cost no bytes of their own. Empty for small swarms.
    cells: dict[str, str] = {}

    def validate(self) -> None:
        """Raise :class:`RecordRejected` on malformed ranges, negative flows, absurd sizes."""
        _check_schema(self.schema)
        _str("model", self.model)
        _str("leader_id", self.leader_id)
        _int("epoch", self.epoch, 0, MAX_EPOCH)
        _int("num_layers", self.num_layers, 1, MAX_LAYERS)
        if len(self.targets) > MAX_PEERS_IN_PLAN or len(self.spans) > MAX_PEERS_IN_PLAN:
            raise RecordRejected("too many peers in plan")
        if len(self.flows) > MAX_FLOWS or len(self.defaulted_links) > MAX_FLOWS:
            raise RecordRejected("too many flows in plan")
        for peer, span in self.targets.items():
            check_span(f"target of {peer}", span, self.num_layers)
        for peer, span in self.spans.items():
            check_span(f"span of {peer}", span, self.num_layers)
        for f in self.flows:
            _finite(f"flow {f.src}->{f.dst}", f.rate, 0.0, MAX_TOKENS_PER_S * MAX_LAYERS)
            for end in (f.src, f.dst):
                if end not in (SOURCE, SINK) and end not in self.spans:
                    raise RecordRejected(f"flow {f.src}->{f.dst} names {end}, which serves nothing in this plan")
        for name, x in (("max_flow", self.max_flow), ("upper_bound", self.upper_bound), ("solve_time", self.solve_time)):
            _finite(name, x, 0.0, 1e12)
        _finite("created_at", self.created_at, 0.0, 1e11)
        if len(self.groupings) > MAX_PEERS_IN_PLAN:
            raise RecordRejected("too many machines in plan")
        if len(self.cells) > MAX_PEERS_IN_PLAN:
            raise RecordRejected("too many cells in plan")
        for peer, cell in self.cells.items():
            _str("cell", cell)
        for machine, degrees in self.groupings.items():
            _str("machine id", machine)
            if not 1 <= len(degrees) <= MAX_MACHINE_SLOTS or sum(degrees) > MAX_MACHINE_SLOTS:
                raise RecordRejected(f"grouping of {len(degrees)} groups over {sum(degrees)} slots")
            for d in degrees:
                _int("TP degree", d, 1, MAX_TP)

    def coverage(self, use_targets: bool = False) -> list[int]:
        """How many peers hold each layer (in ``spans``, or in ``targets`` if asked)."""
        cover = [0] * self.num_layers
        for start, end in (self.targets if use_targets else self.spans).values():
            for layer in range(start, end):
                cover[layer] += 1
        return cover


Record = Union[PeerInfo, LinkInfo, CoordinatorCandidate, Plan]
R = TypeVar("R", PeerInfo, LinkInfo, CoordinatorCandidate, Plan)

_ENCODER = msgspec.msgpack.Encoder()
_DECODERS: dict[type, msgspec.msgpack.Decoder] = {}
MAX_RECORD_BYTES = 4 << 20  # a 4096-peer plan is well under this


def encode_record(record: Record) -> bytes:
    """MessagePack bytes of a record (no signature; the DHT validator appends that)."""
    return _ENCODER.encode(record)


def decode_record(data: bytes, cls: type[R], num_layers: Optional[int] = None) -> R:
    """Decode and validate untrusted bytes into ``cls`` (against the model's ``num_layers``
    when the reader knows it).

    Raises :class:`MalformedFrameError` (bad MessagePack / wrong field types) or
    :class:`RecordRejected` (decoded, but figures out of bounds), each with a reason.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedFrameError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_RECORD_BYTES:
        raise MalformedFrameError(f"record of {len(data)} bytes exceeds {MAX_RECORD_BYTES}")
    dec = _DECODERS.get(cls)
    if dec is None:
        dec = _DECODERS[cls] = msgspec.msgpack.Decoder(cls)
    try:
        record = dec.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        # msgspec raises UnicodeDecodeError, not a DecodeError, for a str that is not UTF-8: one
        # such record under a signed subkey used to make every reader's get_peers() raise
        raise MalformedFrameError(f"not a valid {cls.__name__}: {e}") from e
    validate_for_model(record, num_layers)
    return record


def validate_for_model(record: Record, num_layers: Optional[int]) -> None:
    """``record.validate()``, and where ``num_layers`` is known, its consistency with the model:
    no PeerInfo span or capacity beyond the model's layers, no plan for another depth."""
    if isinstance(record, PeerInfo):
        record.validate(num_layers)
        return
    record.validate()
    if isinstance(record, Plan) and num_layers is not None and record.num_layers != num_layers:
        raise RecordRejected(f"plan for {record.num_layers} layers; this model has {num_layers}")
