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


class SamplingParams(msgspec.Struct, frozen=True):
    """How the peer holding the last layer picks the next token.

    temperature 0 means greedy. The random draw for the token at absolute position p uses a
    generator seeded from (seed, p), so replaying a session reproduces its tokens exactly.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> str | None:
        """Return a reason if the parameters are unusable, else None."""
        if not (0.0 <= self.temperature <= 100.0) or math.isnan(self.temperature):
            return f"temperature must be in [0, 100], got {self.temperature}"
        if self.top_k < 0:
            return f"top_k must be >= 0, got {self.top_k}"
        if not (0.0 < self.top_p <= 1.0):
            return f"top_p must be in (0, 1], got {self.top_p}"
        return None
