"""Session frame headers: requests (the peer decodes them), replies (the client does), frame
prefixes, tensor headers and sampling parameters.

Property: each decoder returns a value of its validated type or raises a ``ProtocolError``; and
what it returns keeps the type's promises (counters non-negative and within int64, a tensor
header that describes exactly its payload, a port a socket accepts, a token id the client can
put in its next int64 input).
"""

from __future__ import annotations

import math
import tracemalloc

import msgspec
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from p2pserve.client.connection import HopConnection
from p2pserve.client.hop import Hop
from p2pserve.errors import (
    WIRE_ERRORS,
    MalformedFrameError,
    ProtocolError,
    error_from_reply,
)
from p2pserve.protocol import (
    DTYPE_SIZES,
    FRAME_PREFIX,
    MAX_TENSOR_DIMS,
    PROTOCOL_VERSION,
    DirectOffer,
    ErrorReply,
    Forward,
    ForwardResult,
    FrameLimits,
    OpenSession,
    PeerStats,
    SamplingParams,
    SessionOpened,
    TensorMeta,
    check_prefix,
    decode_reply,
    decode_request,
)
from p2pserve.transport.frames import tensor_from_wire
from tests.fuzz import FUZZ, counted
from tests.fuzz.messages import replies, requests, tensor_headers
from tests.fuzz.mutate import CLAIMS, INT_EXTREMES, hostile, pack
from tests.support.wire import claimed_metas

INT64_MAX = 2**63 - 1
_ENC = msgspec.msgpack.Encoder()


def assert_counter(name: str, value) -> None:
    """A wire counter: an int (not a bool) in [0, 2**63)."""
    assert type(value) is int and 0 <= value <= INT64_MAX, f"{name}={value!r}"


def check_tensor(meta: TensorMeta, payload_len: int) -> None:
    """A tensor header either fails validation, typed, or rebuilds a tensor of exactly its payload."""
    try:
        meta.validate(payload_len)
    except MalformedFrameError:
        return
    assert meta.dtype in DTYPE_SIZES and len(meta.shape) <= MAX_TENSOR_DIMS
    assert all(type(d) is int and d >= 0 for d in meta.shape)
    assert meta.nbytes == payload_len == math.prod(meta.shape) * DTYPE_SIZES[meta.dtype]
    if payload_len <= 1 << 20:
        t = tensor_from_wire(meta, bytes(payload_len))
        assert list(t.shape) == list(meta.shape)
        assert t.untyped_storage().nbytes() <= payload_len  # never more than what arrived


def check_request(msg) -> None:
    if isinstance(msg, OpenSession):
        assert msg.version == PROTOCOL_VERSION
        for name in ("start", "end", "max_length"):
            assert_counter(name, getattr(msg, name))
        reason = msg.sampling.validate()  # a reason or None, never an exception
        assert reason is None or isinstance(reason, str)
    elif isinstance(msg, Forward):
        assert_counter("step", msg.step)
        assert_counter("position", msg.position)
        check_tensor(msg.tensor, msg.tensor.nbytes)  # as the peer does: the frame carries what the header says
    # decoding what we decoded gives the same message (byte-equal: NaN != NaN)
    assert _ENC.encode(decode_request(_ENC.encode(msg))) == _ENC.encode(msg)


@FUZZ
@given(hostile(requests))
@example(pack({"t": "forward", "session_id": "s", "step": 0, "position": 0,
               "tensor": {"dtype": "float32", "shape": [0, 2**63], "nbytes": 0}}))
@example(pack({"t": "forward", "session_id": "s", "step": 2**64 - 1, "position": 0,
               "tensor": {"dtype": "int64", "shape": [1], "nbytes": 8}}))
@counted("protocol.decode_request")
def test_decode_request(raw):
    try:
        msg = decode_request(raw)
    except ProtocolError:
        return
    check_request(msg)


def _opened(hidden: int = 8) -> HopConnection:
    conn = HopConnection(transport=None, hop=Hop("peer", 0, 1), limits=FrameLimits(), timeout_s=1.0)
    conn.opened = SessionOpened(session_id="s", start=0, end=1, served_start=0, served_end=1, hidden_size=hidden,
                                dtype="float32", peer_version="")
    return conn


def check_reply(reply) -> None:
    """What the client relies on in a decoded reply, checked as the client checks it."""
    if isinstance(reply, ErrorReply):
        assert isinstance(error_from_reply(reply.code, reply.message, peer="p"), WIRE_ERRORS)
    elif isinstance(reply, ForwardResult):
        assert_counter("step", reply.step)
        assert_counter("position", reply.position)
        assert reply.token is None or (type(reply.token) is int and 0 <= reply.token <= INT64_MAX)
        if reply.tensor is not None and type(reply.tensor.nbytes) is int and 0 <= reply.tensor.nbytes <= 1 << 20:
            payload = bytes(reply.tensor.nbytes)
            try:
                _opened().hidden_of(reply, payload, reply.tensor.shape[0] if reply.tensor.shape else 0)
            except MalformedFrameError:
                pass
            check_tensor(reply.tensor, len(payload))
    elif isinstance(reply, SessionOpened):
        for name in ("start", "end", "served_start", "served_end", "hidden_size"):
            assert_counter(name, getattr(reply, name))
    elif isinstance(reply, PeerStats):
        for name in ("served_start", "served_end", "sessions", "kv_capacity_token_layers", "kv_free_token_layers",
                     "queued_tokens", "steps", "tokens", "max_batch_tokens", "max_batch_sessions", "inline_steps",
                     "compute_restarts"):
            assert_counter(name, getattr(reply, name))
    elif isinstance(reply, DirectOffer):
        assert type(reply.port) is int and 0 <= reply.port <= 65535, reply.port
    assert _ENC.encode(decode_reply(_ENC.encode(reply))) == _ENC.encode(reply)


@FUZZ
@given(hostile(replies))
@example(pack({"t": "direct_offer", "port": 70000, "token": "x"}))
@example(pack({"t": "result", "session_id": "s", "step": 0, "position": 1, "token": 2**64 - 1}))
@counted("protocol.decode_reply")
def test_decode_reply(raw):
    try:
        reply = decode_reply(raw)
    except ProtocolError:
        return
    check_reply(reply)


prefixes = st.one_of(
    st.binary(max_size=20),
    st.builds(FRAME_PREFIX.pack, st.integers(0, 2**32 - 1) | st.sampled_from([0, 1, 2**32 - 1]),
              st.integers(0, 2**64 - 1) | st.sampled_from([0, 1, 2**63, 2**64 - 1])),
)
limits = st.builds(FrameLimits, max_header_bytes=st.integers(0, 1 << 20), max_payload_bytes=st.integers(0, 1 << 30))


@FUZZ
@given(prefixes, limits)
@example(b"\x00\x00\x00\x01", FrameLimits())
@counted("protocol.check_prefix")
def test_check_prefix(prefix, lim):
    try:
        header_len, payload_len = check_prefix(prefix, lim)
    except ProtocolError:
        return
    assert len(prefix) == FRAME_PREFIX.size
    assert 0 < header_len <= lim.max_header_bytes and 0 <= payload_len <= lim.max_payload_bytes


#: A Forward header up to its tensor field: a map of 5 entries whose last value is the tensor header.
_FORWARD_PREFIX = b"\x85" + b"".join(pack(x) for x in ("t", "forward", "session_id", "s", "step", 0, "position", 0,
                                                        "tensor"))


@FUZZ
@given(claimed_metas() | st.tuples(hostile(tensor_headers), st.integers(0, 1 << 20)))
@example((TensorMeta("float32", [0, 2**62, 2**62], 0), 0))
@example((TensorMeta("float32", [0, 2**64 - 1], 0), 0))
@counted("protocol.TensorMeta.validate")
def test_tensor_meta(case):
    meta, payload_len = case
    if isinstance(meta, bytes):  # a tensor header as it arrives: decoded inside its Forward
        try:
            meta = decode_request(_FORWARD_PREFIX + meta).tensor
        except ProtocolError:
            return
    check_tensor(meta, payload_len if type(payload_len) is int and payload_len >= 0 else 0)


@FUZZ
@given(st.builds(SamplingParams, temperature=st.floats() | st.integers(-5, 5), top_k=st.sampled_from(INT_EXTREMES),
                 top_p=st.floats() | st.integers(-5, 5), seed=st.sampled_from(INT_EXTREMES) | st.integers()))
@counted("protocol.SamplingParams.validate")
def test_sampling_params(params):
    reason = params.validate()
    if reason is None:
        assert 0.0 <= params.temperature <= 100.0 and params.top_k >= 0 and 0.0 < params.top_p <= 1.0


@st.composite
def claimed(draw) -> bytes:
    """A valid request or reply with a size marker spliced in that claims up to 4 GiB more."""
    raw = pack(draw(requests | replies))
    i = draw(st.integers(0, len(raw)))
    return raw[:i] + draw(st.sampled_from(CLAIMS)) + raw[i:]


@FUZZ
@given(claimed())
@counted("protocol.claimed_sizes")
def test_claimed_sizes_allocate_nothing(raw):
    """A header claiming a huge array, map, string or binary is refused for the bytes that are
    there, not allocated for the ones it claims."""
    tracemalloc.start()
    try:
        for decode in (decode_request, decode_reply):
            try:
                decode(raw)
            except ProtocolError:
                pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 64 * 1024 + 16 * len(raw), f"{peak} bytes traced decoding {len(raw)} bytes"


@pytest.mark.parametrize("raw", [b"", b"\xc1", pack({"t": "open"}), pack([1, 2, 3])])
def test_garbage_is_malformed(raw):
    """The plain cases the properties generalise: each decoder names the input malformed."""
    with pytest.raises(MalformedFrameError):
        decode_request(raw)
    with pytest.raises(MalformedFrameError):
        decode_reply(raw)
