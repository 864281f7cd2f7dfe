"""Valid messages of every kind that crosses the network, as strategies of plain builtins.

These are the seeds that :func:`tests.fuzz.mutate.mutated` damages: a session frame header
(requests and replies), a tensor header, and the four DHT records. Each is what an honest
sender writes (``msgspec.to_builtins`` of the real struct), so that a mutation changes one
thing and the rest still reaches the decoder's validation.
"""

from __future__ import annotations

import math

import msgspec
from hypothesis import strategies as st

from p2pserve.dht.machine_info import GPU_LINK_KINDS, GpuLink, GpuOffer, MachineGroup, MachineInfo
from p2pserve.dht.records import (
    CoordinatorCandidate,
    Flow,
    LinkInfo,
    LinkStat,
    PeerInfo,
    Plan,
)
from p2pserve.protocol import (
    DTYPE_SIZES,
    PROTOCOL_VERSION,
    AllowPush,
    AwaitResult,
    AttachDirect,
    CloseSession,
    DirectAttached,
    DirectOffer,
    ErrorReply,
    Forward,
    ForwardResult,
    GetStats,
    OpenDirect,
    OpenSession,
    PeerStats,
    PushAck,
    PushAllowed,
    PushForward,
    PushHop,
    RingGrant,
    RingStopped,
    SamplingParams,
    SessionClosed,
    SessionOpened,
    TensorMeta,
)
from p2pserve.types import SINK, SOURCE

ids = st.text(min_size=1, max_size=16)
small = st.integers(0, 4096)
peer_ids = st.text("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz", min_size=1, max_size=16)  # base58
finite = st.floats(0.0, 1e6, allow_nan=False, allow_infinity=False)


@st.composite
def tensor_metas(draw) -> TensorMeta:
    """A consistent tensor header: dtype, up to 4 small dims, and their byte count."""
    dtype = draw(st.sampled_from(sorted(DTYPE_SIZES)))
    shape = draw(st.lists(st.integers(0, 64), max_size=4))
    return TensorMeta(dtype=dtype, shape=shape, nbytes=math.prod(shape) * DTYPE_SIZES[dtype])


sampling = st.builds(SamplingParams, temperature=st.floats(0.0, 100.0), top_k=st.integers(0, 1000),
                     top_p=st.floats(0.01, 1.0), seed=st.integers(0, 2**32))

requests = st.one_of(
    st.builds(OpenSession, version=st.just(PROTOCOL_VERSION), model_id=ids, session_id=ids, start=small, end=small,
              max_length=small, sampling=sampling, background=st.booleans()),
    st.builds(Forward, session_id=ids, step=small, position=small, tensor=tensor_metas()),
    st.builds(CloseSession, session_id=ids),
    st.just(GetStats()),
    st.just(OpenDirect()),
    st.builds(AttachDirect, token=st.text(max_size=32)),
    st.builds(AllowPush, session_id=ids, from_peer=peer_ids),
    st.builds(AllowPush, session_id=ids, from_peer=peer_ids, ring=st.builds(
        RingGrant, start_step=small, start_position=small, start_tokens=st.integers(1, 64), max_position=small,
        stop_tokens=st.lists(small, max_size=4), route=st.lists(st.builds(PushHop, peer_id=peer_ids, session_id=ids),
                                                                max_size=3),
        successor=st.none() | st.builds(PushHop, peer_id=peer_ids, session_id=ids))),
    st.builds(AwaitResult, session_id=ids, step=small, ring_until=small),
    st.builds(PushForward, forward=st.builds(Forward, session_id=ids, step=small, position=small,
                                             tensor=tensor_metas()),
              route=st.lists(st.builds(PushHop, peer_id=peer_ids, session_id=ids), max_size=3), ring=st.booleans()),
).map(msgspec.to_builtins)

replies = st.one_of(
    st.builds(SessionOpened, session_id=ids, start=small, end=small, served_start=small, served_end=small,
              hidden_size=small, dtype=st.sampled_from(sorted(DTYPE_SIZES)), peer_version=st.text(max_size=8)),
    st.builds(ForwardResult, session_id=ids, step=small, position=small,
              tensor=st.none() | tensor_metas(), token=st.none() | st.integers(0, 50_000)),
    st.builds(SessionClosed, session_id=ids),
    st.builds(PeerStats, model_id=ids, served_start=small, served_end=small, sessions=small,
              kv_capacity_token_layers=small, kv_free_token_layers=small, queued_tokens=small, steps=small,
              tokens=small, max_batch_tokens=small, max_batch_sessions=small, service_ms=finite, compute_ms=finite),
    st.builds(DirectOffer, port=st.integers(0, 65535), token=st.text(max_size=32)),
    st.builds(DirectAttached, peer_id=ids),
    st.builds(PushAllowed, session_id=ids),
    st.builds(PushAck, session_id=ids, step=small),
    st.builds(RingStopped, session_id=ids, step=small),
    st.builds(ErrorReply, code=st.sampled_from(["malformed", "overloaded", "bad_request", "nonsense"]),
              message=st.text(max_size=40), session_id=st.none() | ids, step=st.none() | small,
              failed_peer=st.none() | peer_ids),
).map(msgspec.to_builtins)

tensor_headers = tensor_metas().map(msgspec.to_builtins)


@st.composite
def spans(draw, num_layers: int):
    """A valid half-open layer range inside ``num_layers``."""
    start = draw(st.integers(0, num_layers - 1))
    return (start, draw(st.integers(start + 1, num_layers)))


@st.composite
def peer_infos(draw) -> PeerInfo:
    """A PeerInfo that passes validation: tables as long as max_layers, ranges within it."""
    max_layers = draw(st.integers(1, 16))
    tables = st.lists(st.floats(0.0, 1e4), min_size=max_layers, max_size=max_layers) | st.just([])
    serving = draw(st.none() | spans(max_layers))
    state = draw(st.sampled_from(["joining", "draining"] + (["serving"] if serving else [])))
    return PeerInfo(model=draw(ids), peer_id=draw(ids), addrs=draw(st.lists(ids, max_size=3)),
                    weights_memory_bytes=draw(st.integers(0, 1 << 40)), kv_memory_bytes=draw(st.integers(0, 1 << 40)),
                    throughput_decode=draw(tables), throughput_prefill=draw(tables), max_layers=max_layers,
                    serving=serving, state=state, kv_free_tokens=draw(small), queued_tokens=draw(small),
                    timestamp=draw(st.floats(0.0, 2e9)))


link_stats = st.builds(LinkStat, bandwidth=st.floats(0.0, 1e10), rtt=st.floats(0.0, 10.0),
                       measured_at=st.floats(0.0, 2e9))


@st.composite
def link_infos(draw) -> LinkInfo:
    """A LinkInfo measured by one peer to a few others (never to itself)."""
    me = draw(ids)
    others = draw(st.dictionaries(ids.filter(lambda p: p != me), link_stats, max_size=4))
    return LinkInfo(model=draw(ids), peer_id=me, links=others, timestamp=draw(st.floats(0.0, 2e9)))


candidates = st.builds(CoordinatorCandidate, model=ids, coordinator_id=ids, priority=st.integers(-100, 100),
                       start_time=st.floats(0.0, 2e9), public_key=st.text(min_size=1, max_size=64))


@st.composite
def plans(draw) -> Plan:
    """A Plan whose spans and targets lie inside the model and whose flows name its peers."""
    num_layers = draw(st.integers(1, 32))
    peers = draw(st.lists(ids, max_size=5, unique=True))
    spans_now = {p: draw(spans(num_layers)) for p in peers}
    targets = {p: draw(spans(num_layers)) for p in peers}
    ends = [SOURCE, SINK, *peers]
    flows = draw(st.lists(st.builds(Flow, st.sampled_from(ends), st.sampled_from(ends), st.floats(0.0, 1e6)),
                          max_size=6))
    return Plan(model=draw(ids), epoch=draw(st.integers(0, 1 << 40)), leader_id=draw(ids), num_layers=num_layers,
                targets=targets, spans=spans_now, flows=flows, max_flow=draw(finite), upper_bound=draw(finite),
                created_at=draw(st.floats(0.0, 2e9)), reason=draw(st.text(max_size=20)),
                groupings=draw(st.dictionaries(ids, st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=2),
                                               max_size=3)))


@st.composite
def machine_infos(draw) -> MachineInfo:
    """A machine agent's offer: 1-8 GPUs (with a profile), measured links between distinct pairs of
    them, and groups on distinct slots."""
    gpus = draw(st.lists(st.builds(GpuOffer, device=ids, memory_bytes=st.integers(1, 1 << 40),
                                   throughput_decode=st.lists(st.floats(0.0, 1e6), max_size=4)), min_size=1, max_size=8))
    pairs = [(a, b) for a in range(len(gpus)) for b in range(a + 1, len(gpus))]
    chosen = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=len(pairs))) if pairs else []
    links = [GpuLink(a=a, b=b, bandwidth=draw(st.floats(1.0, 1e12)), latency_s=draw(st.floats(0.0, 1.0)),
                     kind=draw(st.sampled_from(sorted(GPU_LINK_KINDS)))) for a, b in chosen]
    slots = draw(st.permutations(range(len(gpus))))
    sizes = draw(st.lists(st.integers(1, 2), max_size=len(gpus)))
    groups, at = [], 0
    for i, size in enumerate(sizes):
        if at + size <= len(gpus):
            groups.append(MachineGroup(slots=list(slots[at:at + size]), peer_id=f"peer{i}"))
            at += size
    degrees = [d for d in (2, 4, 8) if d <= len(gpus) and draw(st.booleans())]
    return MachineInfo(model=draw(ids), machine_id=draw(peer_ids), gpus=gpus, links=links, groups=groups,
                       tp_degrees=degrees, timestamp=draw(st.floats(0.0, 2e9)))


RECORDS = {
    PeerInfo: peer_infos().map(msgspec.to_builtins),
    LinkInfo: link_infos().map(msgspec.to_builtins),
    CoordinatorCandidate: candidates.map(msgspec.to_builtins),
    Plan: plans().map(msgspec.to_builtins),
    MachineInfo: machine_infos().map(msgspec.to_builtins),
}
