"""Every message that crosses the wire, and how frames are laid out. No I/O here.

A frame is ``[u32 header_len][u64 payload_len][header][payload]`` (big-endian). The header is a
MessagePack map decoded by msgspec straight into one of the typed structs below (tagged by its
``t`` field); the payload is raw tensor bytes described by a ``TensorMeta`` in the header. Sizes
are checked against limits before anything is allocated, and nothing is ever unpickled.

Client -> peer: ``OpenSession``, ``Forward``, ``CloseSession``, ``GetStats``, ``OpenDirect``,
``AttachDirect``, ``AllowPush``, ``PushForward`` (also peer -> next peer, push mode), ``AwaitResult``.
Peer -> client: ``SessionOpened``, ``ForwardResult``, ``SessionClosed``, ``PeerStats``,
``DirectOffer``, ``DirectAttached``, ``PushAllowed``, ``PushAck`` (also peer -> previous peer), ``RingStopped``,
``ErrorReply``.

Their building blocks (bounded integers, ``TensorMeta``, ``SamplingParams``) are in ``wire_types.py``.
The same frames travel on a libp2p stream or, after ``OpenDirect``/``AttachDirect``, on a TLS
connection to the peer pinned by the offer (the direct path; see ``p2pserve/transport/tcp.py``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Annotated, Union

import msgspec

from p2pserve.errors import (
    ErrorCode,
    MalformedFrameError,
    PayloadTooLargeError,
    VersionMismatchError,
)
from p2pserve.types import PeerId, SessionId
from p2pserve.wire_types import (  # noqa: F401 (re-exported: every message is built from them)
    DTYPE_SIZES as DTYPE_SIZES,
    MAX_TENSOR_DIMS as MAX_TENSOR_DIMS,
    MAX_TENSOR_EXTENT as MAX_TENSOR_EXTENT,
    MAX_PUSH_HOPS as MAX_PUSH_HOPS,
    MAX_RING_AHEAD as MAX_RING_AHEAD,
    MAX_RING_STOP_TOKENS as MAX_RING_STOP_TOKENS,
    Fingerprint,
    Logprobs,
    NonNegative,
    PeerIdText as PeerIdText,
    Port,
    PushHop,
    RingGrant,
    SamplingParams,
    SessionIdText,
    TensorMeta,
)

PROTOCOL_VERSION = 2
SESSION_PROTOCOL = "/p2pserve/session/1"

FRAME_PREFIX = struct.Struct(">IQ")  # header_len, payload_len
#: The most positions whose next token one Forward may ask the last hop for (speculative decoding
#: verifies k draft tokens with k + 1 of them; docs/speculative.md). A bound on the wire, so that a
#: hostile value is refused by the decoder before any work: 64 is far past any useful draft.
MAX_VERIFY_OUTPUTS = 64


@dataclass(frozen=True)
class FrameLimits:
    """Upper bounds checked before any allocation; configured per role."""

    max_header_bytes: int = 64 * 1024
    max_payload_bytes: int = 256 * 1024 * 1024


class OpenSession(msgspec.Struct, frozen=True, tag_field="t", tag="open"):
    """Open a session that will run layers [start, end) of ``model_id`` on this peer.

    ``max_length`` bounds the positions the session will ever hold; the peer reserves that much
    KV cache up front (or answers "overloaded"). When ``end`` is the model's last layer the
    peer samples a token with ``sampling``; otherwise it returns hidden states.
    ``background`` asks the peer to run the session's Forwards only in steps that have no other
    work (a verifier's witness replay: it must not delay anyone's tokens); it lowers the session's own
    priority and nothing else. ``fork_of``: begin with that session's first ``fork_at`` positions (same owner).
    """

    version: int
    model_id: str
    session_id: SessionId
    start: NonNegative
    end: NonNegative
    max_length: NonNegative
    sampling: SamplingParams = SamplingParams()
    background: bool = False
    fork_of: SessionIdText | None = None
    fork_at: NonNegative = 0


#: How many trailing positions of a Forward the last hop returns a next token for.
Outputs = Annotated[int, msgspec.Meta(ge=1, le=MAX_VERIFY_OUTPUTS)]


class Forward(msgspec.Struct, frozen=True, omit_defaults=True, tag_field="t", tag="forward"):
    """Run tokens [position, position + n) of a session through its span.

    The payload is token ids (int64 [n]) when the span starts at layer 0, else hidden states
    [n, hidden]. ``position`` below the session's length rewinds the cache to it first.
    ``outputs`` (1 to ``MAX_VERIFY_OUTPUTS``, at most n) asks the hop holding the last layer for
    the token after each of the last ``outputs`` positions (greedy or seeded per position, as for
    one token): speculative decoding verifies k draft tokens with k + 1 of them. Hops before the
    last only accept 1. Left at 1 it is not encoded at all, so the one-token path is unchanged.

    For the last hop only (each left out unless used): ``context``, the token ids at this
    Forward's n positions, which the session keeps as its history for the penalties of its
    ``SamplingParams`` and for ``prompt_logprobs``; ``prompt_logprobs`` asks for the
    log-probability of each of ``context[1:]`` given what precedes it
    (``ForwardResult.prompt_logprobs``); ``allowed``, a bitmask of the tokens the next one may be
    (bit t of little-endian int32 word t // 32, ceil(V / 32) words), which the client's grammar
    (structured output) computed.
    """

    session_id: SessionId
    step: NonNegative
    position: NonNegative
    tensor: TensorMeta
    outputs: Outputs = 1
    context: list[NonNegative] | None = None
    prompt_logprobs: bool = False
    allowed: bytes | None = None


class CloseSession(msgspec.Struct, frozen=True, tag_field="t", tag="close"):
    """Free a session's KV cache now instead of waiting for the idle timeout."""

    session_id: SessionId


class GetStats(msgspec.Struct, frozen=True, tag_field="t", tag="get_stats"):
    """Ask the peer for its load and batching counters (no session needed)."""


class OpenDirect(msgspec.Struct, frozen=True, tag_field="t", tag="open_direct"):
    """Ask for a direct TCP endpoint (sent on the authenticated libp2p stream)."""


class AttachDirect(msgspec.Struct, frozen=True, tag_field="t", tag="attach_direct"):
    """First frame on a direct TCP connection: the token a ``DirectOffer`` gave. ``mux``: the
    client would carry many streams on this connection (``transport/mux.py``)."""

    token: str
    mux: bool = False


class DirectOffer(msgspec.Struct, frozen=True, tag_field="t", tag="direct_offer"):
    """Where to connect directly (``port`` 0: this peer offers no direct path), the one-time token
    that binds that connection to the client, and the SHA-256 of the TLS certificate the port
    presents (lowercase hex). This travels on the libp2p stream, authenticated to the peer id, so
    the client accepts a TLS endpoint only if it shows that certificate; an offer without one is
    not taken (the token never goes to an unpinned endpoint)."""

    port: Port
    token: str = ""
    tls_sha256: Fingerprint = ""


class DirectAttached(msgspec.Struct, frozen=True, tag_field="t", tag="direct_attached"):
    """The direct connection is accepted (its token redeemed). ``peer_id`` is an echo, checked
    for consistency only: what proves whom the client reached is the pinned TLS certificate.
    ``mux``: the connection carries many streams from now on, else the one it was opened for."""

    peer_id: PeerId
    mux: bool = False


class SessionOpened(msgspec.Struct, frozen=True, tag_field="t", tag="opened"):
    """The session is open; echoes what the peer serves so the client can check the chain."""

    session_id: SessionId
    start: NonNegative
    end: NonNegative
    served_start: NonNegative
    served_end: NonNegative
    hidden_size: NonNegative
    dtype: str
    peer_version: str
    # the peer's signed receipt for the stream's client (dht/receipts.py): its reports count with it
    receipt: Annotated[bytes, msgspec.Meta(max_length=64)] = b""


class ForwardResult(msgspec.Struct, frozen=True, tag_field="t", tag="result"):
    """Output of one Forward: hidden states (payload) or, at the last layer, a sampled token.

    A Forward with ``outputs`` m > 1 gets ``tokens`` (m of them, the token after each of its last
    m positions, in order) instead of ``token``; their digest is that of :func:`tokens_bytes`.
    ``logprobs`` and ``prompt_logprobs`` come back when the session or the Forward asked for them.
    ``signature`` is the peer's Ed25519 reply-key signature over the reply's claim (the span,
    positions, a commitment to every input the session consumed, the output's digest:
    ``p2pserve.dht.evidence.ReplyClaim``); empty from a peer that does not sign.
    """

    session_id: SessionId
    step: NonNegative
    position: NonNegative
    tensor: TensorMeta | None = None
    token: NonNegative | None = None
    signature: Annotated[bytes, msgspec.Meta(max_length=64)] = b""
    tokens: Annotated[list[NonNegative], msgspec.Meta(max_length=MAX_VERIFY_OUTPUTS)] | None = None
    logprobs: Logprobs | None = None  # the sampled token(s)' (``SamplingParams.logprobs``)
    prompt_logprobs: Logprobs | None = None  # ``Forward.prompt_logprobs``: n - 1 rows


class SessionClosed(msgspec.Struct, frozen=True, tag_field="t", tag="closed"):
    """Acknowledges CloseSession."""

    session_id: SessionId


class PeerStats(msgspec.Struct, frozen=True, tag_field="t", tag="stats"):
    """Live load and counters of a peer."""

    model_id: str
    served_start: NonNegative
    served_end: NonNegative
    sessions: NonNegative
    kv_capacity_token_layers: NonNegative
    kv_free_token_layers: NonNegative
    queued_tokens: NonNegative
    steps: NonNegative
    tokens: NonNegative
    max_batch_tokens: NonNegative
    max_batch_sessions: NonNegative
    inline_steps: NonNegative = 0  # steps run on the I/O thread for a lone session (see peer/worker.py)
    # Medians over the last 64 Forwards / compute steps (``peer/timing.py``), in ms: the time a Forward
    # spends in the peer (frame read to reply written) and the shard's compute per step. A
    # client's round trip minus ``service_ms`` is what the wire and the client cost.
    service_ms: float = 0.0
    compute_ms: float = 0.0
    # The watchdog's view (peer/worker.py): whether the compute thread runs, how often it was
    # restarted, and how long the running step has taken so far.
    compute_alive: bool = True
    compute_restarts: NonNegative = 0
    stuck_s: float = 0.0


class ErrorReply(msgspec.Struct, frozen=True, tag_field="t", tag="error"):
    """A typed error: ``code`` is an ErrorCode value; ``message`` says what to do about it.
    ``failed_peer`` (push mode only): the later hop of the route that failed or could not be
    reached, as the hop relaying this error saw it; None: the peer answering failed itself."""

    code: str
    message: str
    session_id: SessionId | None = None
    step: NonNegative | None = None
    failed_peer: str | None = None


class AllowPush(msgspec.Struct, frozen=True, tag_field="t", tag="allow_push"):
    """Sent by a session's owner: accept ``PushForward`` for this session from ``from_peer`` (the
    previous hop, authenticated by its peer id on the stream it opens). Answered by ``PushAllowed``.
    With ``ring``, ``from_peer`` may push only that ring's steps (for the first hop: the last
    hop's, which close the ring); a later grant replaces an earlier one."""

    session_id: SessionIdText
    from_peer: PeerIdText
    ring: RingGrant | None = None


class PushAllowed(msgspec.Struct, frozen=True, tag_field="t", tag="push_allowed"):
    """Acknowledges AllowPush."""

    session_id: SessionId


class PushForward(msgspec.Struct, frozen=True, tag_field="t", tag="push_forward"):
    """Push mode: run ``forward`` here, then send its output on to ``route[0]`` with the rest of
    ``route``. ``forward.outputs`` is what the last hop returns (hops before it run with 1). The
    last hop hands its ForwardResult to the owner's ``AwaitResult``; every hop answers whoever
    pushed to it with ``PushAck`` once the rest of the chain has acked (or an ErrorReply)."""

    forward: Forward
    route: Annotated[list[PushHop], msgspec.Meta(max_length=MAX_PUSH_HOPS)] = []
    ring: bool = False  # a step of a granted ring (``RingGrant``): the last hop may push the next one


#: The most ring steps one PushBatch may carry (a peer's step of every session it holds).
MAX_BATCH_ITEMS = 256


class PushBatch(msgspec.Struct, frozen=True, tag_field="t", tag="push_batch"):
    """Ring steps of several sessions that one peer sends on to the same next peer, in one frame
    on that pair's one stream (``peer/batch_link.py``): one step of a peer's batch stays one
    step at the next. ``items[i]`` is a ring step (``ring`` set) whose payload is the next ``items[i].forward.tensor.nbytes`` bytes of the frame's payload.
    Answered by one ``PushBatchAck`` once every item ran here and was sent on; a stream's batches
    run side by side, so acks come in the order batches finish, and a refusal of the whole frame
    is an ErrorReply naming ``seq`` as its step."""

    seq: NonNegative
    items: Annotated[list[PushForward], msgspec.Meta(min_length=1, max_length=MAX_BATCH_ITEMS)]

    @property
    def step(self) -> int:
        """What a refusal of the whole batch names as its step (``ErrorReply.step``): its seq."""
        return self.seq


class PushBatchAck(msgspec.Struct, frozen=True, tag_field="t", tag="push_batch_ack"):
    """Every item of PushBatch ``seq`` ran here and was sent on, except those in ``failed``: an
    ErrorReply per failed item, naming its session (this peer's id for it) and step."""

    seq: NonNegative
    failed: Annotated[list[ErrorReply], msgspec.Meta(max_length=MAX_BATCH_ITEMS)] = []


class AwaitResult(msgspec.Struct, frozen=True, tag_field="t", tag="await_result"):
    """Sent by a session's owner to the route's last hop, together with the step's PushForward to
    the first hop: answered with that step's ForwardResult (or ErrorReply) as soon as the pushed
    step has run here, so the token goes straight to the client, not back along the chain."""

    session_id: SessionIdText
    step: NonNegative
    ring_until: NonNegative = 0  # ring mode: the last hop may push steps up to this one (the owner's credit)


class RingStopped(msgspec.Struct, frozen=True, tag_field="t", tag="ring_stopped"):
    """Answers an ``AwaitResult`` for a step past the ring's end: the ring stopped after ``step``
    (a stop token, or its ``max_position``)."""

    session_id: SessionId
    step: NonNegative


class PushAck(msgspec.Struct, frozen=True, tag_field="t", tag="push_ack"):
    """A pushed step ran on this hop and every later one (the last hop's result went to the
    owner's AwaitResult)."""

    session_id: SessionId
    step: NonNegative


Request = Union[OpenSession, Forward, CloseSession, GetStats, OpenDirect, AttachDirect, AllowPush, PushForward,
                AwaitResult, PushBatch]
Reply = Union[SessionOpened, ForwardResult, SessionClosed, PeerStats, DirectOffer, DirectAttached, ErrorReply,
              PushAllowed, PushAck, RingStopped, PushBatchAck]

_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_encoder = msgspec.msgpack.Encoder()
#: What msgspec raises on bad input. A str that is not UTF-8 raises UnicodeDecodeError, which is
#: not a msgspec.DecodeError: it used to escape every decoder as an untyped error.
_DECODE_ERRORS = (msgspec.DecodeError, UnicodeDecodeError)


def encode_frame(message: msgspec.Struct, payload: bytes | memoryview = b"") -> tuple[bytes, bytes, bytes | memoryview]:
    """Serialize a message and its raw payload into frame parts (written without copying):
    (prefix, header, payload)."""
    header = _encoder.encode(message)
    return FRAME_PREFIX.pack(len(header), len(payload)), header, payload


def check_prefix(prefix: bytes, limits: FrameLimits) -> tuple[int, int]:
    """Parse a frame prefix and enforce limits before the body is read."""
    if len(prefix) != FRAME_PREFIX.size:
        raise MalformedFrameError(f"a frame prefix is {FRAME_PREFIX.size} bytes, got {len(prefix)}")
    header_len, payload_len = FRAME_PREFIX.unpack(prefix)
    if header_len == 0 or header_len > limits.max_header_bytes:
        raise PayloadTooLargeError(
            f"frame header of {header_len} bytes is outside (0, {limits.max_header_bytes}]"
        )
    if payload_len > limits.max_payload_bytes:
        raise PayloadTooLargeError(
            f"payload of {payload_len} bytes exceeds the limit of {limits.max_payload_bytes}"
        )
    return header_len, payload_len


def decode_request(header: bytes) -> Request:
    """Decode a client->peer header; raises MalformedFrameError / VersionMismatchError."""
    try:
        msg = _request_decoder.decode(header)
    except _DECODE_ERRORS as e:
        raise MalformedFrameError(f"cannot decode request: {e}") from None
    if isinstance(msg, OpenSession) and msg.version != PROTOCOL_VERSION:
        raise VersionMismatchError(
            f"client speaks protocol {msg.version}, this peer speaks {PROTOCOL_VERSION}; upgrade p2pserve"
        )
    return msg


def decode_reply(header: bytes) -> Reply:
    """Decode a peer->client header; raises MalformedFrameError."""
    try:
        return _reply_decoder.decode(header)
    except _DECODE_ERRORS as e:
        raise MalformedFrameError(f"cannot decode reply: {e}") from None


def tokens_bytes(tokens: list[int]) -> bytes:
    """The bytes a reply's ``tokens`` are signed as: each an int64, big-endian."""
    return struct.pack(f">{len(tokens)}q", *tokens)


def error_reply(code: ErrorCode, message: str, session_id: SessionId | None = None, step: int | None = None,
                failed_peer: str | None = None) -> ErrorReply:
    """Build an ErrorReply from an ErrorCode."""
    return ErrorReply(code=code.value, message=message, session_id=session_id, step=step, failed_peer=failed_peer)
