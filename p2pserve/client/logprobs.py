"""Log-probabilities from the last hop, checked and unpacked.

The last hop returns them packed (``wire_types.Logprobs``: float32 and int32 arrays as bytes);
like every byte from the network they are hostile until checked here: the lengths must match
the rows asked for and the alternatives' count, ids must be in the vocabulary and values finite
log-probabilities (<= 0, up to rounding). A reply that fails is the hop's failure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from p2pserve.errors import MalformedFrameError
from p2pserve.protocol import Logprobs

#: How far above 0 a float32 log-probability may round (log_softmax of the top token).
ROUNDING = 1e-3


@dataclass
class TokenLogprob:
    """One position's token, its log-probability, and the most likely alternatives (id, logprob)."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def check_logprobs(lp: Optional[Logprobs], count: int, k: int, vocab_size: int) -> Logprobs:
    """``lp`` when it holds ``count`` rows of ``k`` alternatives within ``vocab_size``; else
    raises ``MalformedFrameError`` saying what is wrong."""
    if lp is None:
        raise MalformedFrameError("the reply lacks the log-probabilities asked for")
    if lp.count != count or lp.k != k:
        raise MalformedFrameError(f"log-probabilities of {lp.count} rows x {lp.k}, expected {count} x {k}")
    if len(lp.chosen) != 4 * count or len(lp.top_ids) != 4 * count * k or len(lp.top_values) != 4 * count * k:
        raise MalformedFrameError("log-probability arrays do not match their row and alternative counts")
    values = np.concatenate([np.frombuffer(lp.chosen, "<f4"), np.frombuffer(lp.top_values, "<f4")])
    if not np.isfinite(values).all() or (values > ROUNDING).any():
        raise MalformedFrameError("log-probabilities must be finite and <= 0")
    ids = np.frombuffer(lp.top_ids, "<i4")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise MalformedFrameError(f"log-probability token ids must be in [0, {vocab_size})")
    return lp


def unpack(lp: Logprobs, tokens: list[int]) -> list[TokenLogprob]:
    """The rows of a checked ``lp``, row i being that of ``tokens[i]``."""
    chosen = np.frombuffer(lp.chosen, "<f4").astype(float)
    ids = np.frombuffer(lp.top_ids, "<i4").reshape(lp.count, lp.k)
    values = np.frombuffer(lp.top_values, "<f4").astype(float).reshape(lp.count, lp.k)
    return [TokenLogprob(int(t), min(float(chosen[i]), 0.0),
                         [(int(a), min(float(b), 0.0)) for a, b in zip(ids[i], values[i])])
            for i, t in enumerate(tokens)]


def check_reply_logprobs(reply, sampling, n: int, msg, vocab_size: Optional[int]) -> None:
    """Check the last hop's ``reply`` to Forward ``msg`` of ``n`` tokens: the log-probabilities
    the session's ``sampling`` and the Forward asked for are there and sane (else raises)."""
    vocab = vocab_size if vocab_size is not None else 1 << 31
    if sampling.logprobs:
        check_logprobs(reply.logprobs, msg.outputs, sampling.top_logprobs, vocab)
    if msg.prompt_logprobs and n > 1:
        check_logprobs(reply.prompt_logprobs, n - 1, sampling.top_logprobs, vocab)
