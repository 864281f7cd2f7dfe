"""The typed building blocks of wire messages (``protocol.py``): bounded integers and strings that
the decoder itself enforces, the header of a tensor payload, and the sampling parameters. No I/O.
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

from p2pserve.dtypes import DTYPE_SIZES
from p2pserve.errors import MalformedFrameError

MAX_TENSOR_DIMS = 4
#: Bound on a tensor shape's extent, empty dimensions counted as 1: an empty tensor holds no bytes,
#: but torch still computes strides from its other dimensions ([0, 2**62, 2**62] overflowed them).
#: 2**40 elements is far past any payload limit and keeps every stride inside int64.
MAX_TENSOR_EXTENT = 1 << 40

#: The most hops a PushForward may name after the one receiving it (a model's route is far shorter).
MAX_PUSH_HOPS = 16
#: The most stop token ids a ring grant may name.
MAX_RING_STOP_TOKENS = 64
#: How many steps past the one its owner waits for a ring may run (a last hop caps the owner's
#: credit there), and so how many results the last hop holds for the owner at most.
MAX_RING_AHEAD = 32
INT64_MAX = (1 << 63) - 1
#: A counter or bound that is never negative, enforced by the decoder itself; and within int64,
#: so that it fits a tensor or a C long wherever it ends up (a token id 2**64-1 from a hostile peer
#: made the client's next input tensor overflow).
NonNegative = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
#: A TCP port (0: none). asyncio refuses any other with OverflowError, which nobody catches.
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
#: A SHA-256 fingerprint in lowercase hex, or "" for none.
Fingerprint = Annotated[str, msgspec.Meta(pattern="^([0-9a-f]{64})?$")]


class TensorMeta(msgspec.Struct, frozen=True):
    """Describes the raw payload bytes: dtype, shape, and their product in bytes."""

    dtype: str
    shape: list[int]
    nbytes: int

    def validate(self, payload_len: int) -> None:
        """Raise MalformedFrameError unless dtype, shape and byte counts agree."""
        if self.dtype not in DTYPE_SIZES:
            raise MalformedFrameError(f"unsupported tensor dtype {self.dtype!r}")
        if len(self.shape) > MAX_TENSOR_DIMS or any(d < 0 for d in self.shape):
            raise MalformedFrameError(f"invalid tensor shape {self.shape}")
        if math.prod(max(d, 1) for d in self.shape) > MAX_TENSOR_EXTENT:
            raise MalformedFrameError(f"tensor shape {self.shape} exceeds {MAX_TENSOR_EXTENT} elements")
        expected = math.prod(self.shape) * DTYPE_SIZES[self.dtype]
        if expected != self.nbytes or self.nbytes != payload_len:
            raise MalformedFrameError(
                f"tensor of shape {self.shape} {self.dtype} needs {expected} bytes, "
                f"header says {self.nbytes}, payload has {payload_len}"
            )


#: The most alternatives a log-probability entry may list (the OpenAI API's ``top_logprobs`` bound).
MAX_TOP_LOGPROBS = 20
#: The most token ids ``SamplingParams.logit_bias`` may name.
MAX_LOGIT_BIAS = 1024


class SamplingParams(msgspec.Struct, frozen=True):
    """How the peer holding the last layer picks the next token.

    temperature 0 means greedy. The random draw for the token at absolute position p uses a
    generator seeded from (seed, p), so replaying a session reproduces its tokens exactly.

    The rest is applied to the fp32 logits before the choice, in this order: ``logit_bias``
    (token id, added value) pairs; ``repetition_penalty`` (transformers' rule: a logit of a token
    seen anywhere in the session's history is divided by it when positive, multiplied when
    negative); ``frequency_penalty`` and ``presence_penalty`` (the OpenAI API's rule: subtract
    ``frequency * count + presence * (count > 0)`` for the tokens at positions from
    ``penalty_start`` on, the generated ones); then temperature, ``top_k``, ``top_p`` and
    ``min_p`` (drop tokens whose probability is below ``min_p`` times the top one). Penalties
    need the session's token history: the client sends it with each Forward to the last hop
    (``Forward.context``). ``logprobs`` asks for the sampled token's log-probability (fp32
    log-softmax of the raw logits) with ``top_logprobs`` alternatives.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_start: int = 0
    logit_bias: Annotated[list[tuple[int, float]], msgspec.Meta(max_length=MAX_LOGIT_BIAS)] = []
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def needs_history(self) -> bool:
        """Whether the choice depends on the session's earlier tokens (the penalties)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> str | None:
        """Return a reason if the parameters are unusable, else None."""
        if not (0.0 <= self.temperature <= 100.0) or math.isnan(self.temperature):
            return f"temperature must be in [0, 100], got {self.temperature}"
        if self.top_k < 0:
            return f"top_k must be >= 0, got {self.top_k}"
        if not (0.0 < self.top_p <= 1.0):
            return f"top_p must be in (0, 1], got {self.top_p}"
        if not (0.0 <= self.min_p <= 1.0):
            return f"min_p must be in [0, 1], got {self.min_p}"
        if not (0.0 < self.repetition_penalty <= 10.0):
            return f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}"
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                return f"{name} must be in [-2, 2], got {value}"
        if not (0 <= self.penalty_start <= INT64_MAX):
            return f"penalty_start must be >= 0, got {self.penalty_start}"
        if not (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            return f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
        for token, bias in self.logit_bias:
            if not (0 <= token <= INT64_MAX) or not (-100.0 <= bias <= 100.0):
                return f"logit_bias must map token ids >= 0 to values in [-100, 100], got {token}: {bias}"
        return None


class Logprobs(msgspec.Struct, frozen=True):
    """Log-probabilities of ``count`` positions' next tokens, packed little-endian: ``chosen``
    float32 [count] (the token that followed or was sampled), ``top_ids`` int32 [count, k] and
    ``top_values`` float32 [count, k] (the k most likely, best first). Validated by the reader
    (:func:`p2pserve.client.logprobs.check_logprobs`): lengths, ids, finite values."""

    count: NonNegative
    k: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)]
    chosen: bytes
    top_ids: bytes = b""
    top_values: bytes = b""


#: A libp2p peer id in base58 (what ``Hop.peer_id`` holds); bounded so a route stays small.
PeerIdText = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern="^[1-9A-HJ-NP-Za-km-z]+$")]
SessionIdText = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class PushHop(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A later hop of a pushed step: the peer and the session the client opened there. No
    addresses: a forwarding peer dials the next hop only where that peer announced itself in its
    own signed PeerInfo (``peer/next_hop.py``), so a client cannot make a peer dial a host of its
    choice; a hop carrying any other field is refused by the decoder."""

    peer_id: PeerIdText
    session_id: SessionIdText


class RingGrant(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The owner's bounds on a ring (``AllowPush.ring``; docs/wan.md, "Ring"): the ring's first
    step is ``start_step`` at ``start_position`` with ``start_tokens`` positions (the owner's own
    push); every later step is one token at the next position, up to ``max_position``. A peer
    accepts from the granted peer exactly these steps, each once and in order, so no peer can
    make another run more than the owner allowed.

    ``stop_tokens``: the last hop does not go on after sampling one, and the first hop refuses
    one as a ring step's input. ``route`` (first hop only): where its ring steps go on, as in a
    PushForward. ``successor`` (last hop only): the first hop, to which it pushes the next step.
    ``context`` (last hop only, for a session whose penalties need its token history): the token
    ids of the first step, as ``Forward.context`` carries them; each later step's is the token
    the last hop sampled before it, which it keeps itself. ``report`` (every hop but the last):
    send the owner each ring step's signed reply unasked, on the owner's stream, once the step
    ran here (the last hop's are asked for: ``AwaitResult`` carries the owner's credit)."""

    start_step: NonNegative
    start_position: NonNegative
    start_tokens: Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]
    max_position: NonNegative
    stop_tokens: Annotated[list[NonNegative], msgspec.Meta(max_length=MAX_RING_STOP_TOKENS)] = []
    route: Annotated[list[PushHop], msgspec.Meta(max_length=MAX_PUSH_HOPS)] = []
    successor: PushHop | None = None
    context: list[NonNegative] | None = None
    report: bool = False
