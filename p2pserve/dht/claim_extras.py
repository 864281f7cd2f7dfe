"""The digest of everything beyond temperature, top-k, top-p and seed that decides a signed token.

A last hop's token also depends on ``min_p``, the penalties (and so the session's token history
from ``Forward.context``), ``logit_bias``, the grammar's mask (``Forward.allowed``), and it
returns log-probabilities. :func:`extras_digest` binds the inputs among them into one 32-byte field
of the claim (``ReplyClaim.extras``), :func:`returned_digest` the log-probabilities returned
(``ReplyClaim.returned``); each empty when unused, so a plain request's claim is unchanged and a
claim made under a penalty or a mask can never pass for one made without (pure: hashing only).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Optional, Sequence

from p2pserve.wire_types import Logprobs, SamplingParams

_TAG = b"p2pserve/claim-extras/1"


def _part(h, data: Optional[bytes]) -> None:
    """Absent (None) and empty hash differently: a length of 2**64 - 1 marks absence."""
    if data is None:
        h.update(struct.pack(">Q", (1 << 64) - 1))
    else:
        h.update(struct.pack(">Q", len(data)) + data)


def _logprobs(lp: Optional[Logprobs]) -> Optional[bytes]:
    if lp is None:
        return None
    return struct.pack(">QQ", lp.count, lp.k) + b"".join(
        struct.pack(">Q", len(b)) + b for b in (lp.chosen, lp.top_ids, lp.top_values))


def extras_digest(sampling: SamplingParams, history: Optional[Sequence[int]] = None,
                  allowed: Optional[bytes] = None) -> bytes:
    """``ReplyClaim.extras`` of a token reply: b"" when the reply used none of them, else the
    sha256 of the sampling extras, the token ``history`` the penalties read (positions [0,
    position + count), bound only when a penalty is on) and the grammar's mask ``allowed``.
    What an honest replica's token depends on besides the claim's own fields: part of
    ``ReplyClaim.terms``."""
    penalties = sampling.needs_history
    if (sampling.min_p == 0.0 and not penalties and not sampling.logit_bias and not sampling.logprobs
            and sampling.top_logprobs == 0 and allowed is None):
        return b""
    h = hashlib.sha256(_TAG)
    h.update(struct.pack(">ddddQ??Q", sampling.min_p, sampling.repetition_penalty, sampling.presence_penalty,
                         sampling.frequency_penalty, sampling.penalty_start if penalties else 0, sampling.logprobs,
                         penalties, sampling.top_logprobs))
    _part(h, b"".join(struct.pack(">Qd", t, b) for t, b in sampling.logit_bias))
    _part(h, struct.pack(f">{len(history)}q", *history) if penalties and history is not None else None)
    _part(h, allowed)
    return h.digest()


def returned_digest(logprobs: Optional[Logprobs] = None, prompt_logprobs: Optional[Logprobs] = None) -> bytes:
    """``ReplyClaim.returned``: the log-probabilities a token reply carried (b"" when none). An
    output, like the token: honest replicas round them differently, so it is signed but not
    among the terms two claims must share."""
    if logprobs is None and prompt_logprobs is None:
        return b""
    h = hashlib.sha256(_TAG + b"|returned")
    _part(h, _logprobs(logprobs))
    _part(h, _logprobs(prompt_logprobs))
    return h.digest()
