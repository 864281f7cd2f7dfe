"""The stateful test's model of one peer: which sessions each owner holds, what the KV budget has
left, and what the peer must answer to each request (pure; no I/O).

It mirrors the documented order of the peer's checks (``peer/handlers.py``, ``peer/sessions.py``,
``peer/kv_cache.py``), so a reply with another code is a finding, not noise. KV is paged: a
session holds its headroom once open, then whole blocks up to its longest Forward; a rewind gives
back the blocks past it, and a Forward that needs more blocks than are free is "overloaded".
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch

from p2pserve.peer.kv_cache import BLOCK_SIZE
from p2pserve.peer.sessions import HEADROOM_TOKENS
from p2pserve.protocol import PROTOCOL_VERSION, ErrorReply, ForwardResult, OpenSession, SamplingParams


@dataclass
class Sess:
    """One open session as its owner knows it.

    ``position`` is the last length the owner knows the peer holds (never more than it holds: a
    Forward that failed may still have filled the cache). ``taint`` is the first position whose
    cache entries came from inputs other than the reference's (random or NaN), None when clean.
    """

    sid: str
    start: int
    end: int
    max_length: int
    held: int  # tokens per layer whose KV blocks the peer holds for it (whole blocks)
    position: int = 0
    taint: Optional[int] = None
    greedy: bool = True  # temperature 0: its tokens are the reference's
    # Prefix sharing (peer/prefix_share.py): what the peer holds at each cached position (a name
    # of the inputs it came from), and the content keys of the leading blocks the peer keys by
    # content (``PagedCache._adopted``): sessions with equal keys hold one copy of those blocks.
    content: list = field(default_factory=list)
    keys: list = field(default_factory=list)

    def rewound(self, q: int) -> None:
        """The peer truncated the session to ``q``: the content past it goes, the keys of blocks
        past q's block go (q's own block stays shared until written)."""
        del self.content[q:]
        del self.keys[-(-q // BLOCK_SIZE):]

    def writes_shared(self, q: int) -> bool:
        """Whether a write at ``q`` lands in a block the peer keys by content (copy or forget)."""
        return q % BLOCK_SIZE != 0 and q // BLOCK_SIZE < len(self.keys)

    def wrote(self, q: int, names: list) -> None:
        """A step computed positions [q, q + len(names)): key every block it filled."""
        if self.writes_shared(q):
            del self.keys[q // BLOCK_SIZE:]
        self.content[q:] = names
        while len(self.keys) < len(self.content) // BLOCK_SIZE:
            b = len(self.keys) + 1
            self.keys.append((self.start, self.end, tuple(self.content[: b * BLOCK_SIZE])))

    @property
    def reserved(self) -> int:
        """Token-layers of the peer's KV pool this session holds."""
        return self.held * (self.end - self.start)

    def clean_below(self, q: int) -> bool:
        """Whether every cached position below ``q`` holds reference inputs."""
        return self.taint is None or self.taint >= q

    def note(self, q: int, honest: bool) -> None:
        """A Forward at ``q`` ran (or may have): positions >= q now hold its inputs."""
        if honest:
            self.taint = self.taint if self.taint is not None and self.taint < q else None
        else:
            self.taint = q if self.taint is None else min(self.taint, q)


@dataclass
class Owner:
    """A client stream and the sessions it opened (a session answers only the stream that opened it)."""

    name: str
    conn: object
    direct: bool
    sessions: dict = field(default_factory=dict)
    closed: list = field(default_factory=list)
    step: int = 0


@dataclass(frozen=True)
class PeerShape:
    """What the test knows of the peer: model shape and KV budget."""

    model_id: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_positions: int
    capacity: int


#: What the stateful runs exercised (printed at the end; the benchmark reports it).
SEEN: Counter = Counter()

SPANS = ["full", "head", "mid", "tail", "empty", "reversed", "beyond", "far"]
VARIANTS = ["ok", "ok", "ok", "model", "version", "sampling"]


def span_of(kind: str, seed: int, n: int) -> tuple[int, int]:
    """A layer range of a kind: valid ones inside [0, n) (``n`` >= 3), then empty, reversed and
    outside ones."""
    cut = 1 + seed % (n - 1)  # 1 .. n-1
    a = 1 + seed % (n - 2)  # 1 .. n-2
    b = a + 1 + (seed // n) % (n - 1 - a)  # a+1 .. n-1
    return {"full": (0, n), "head": (0, cut), "mid": (a, b), "tail": (cut, n), "empty": (cut, cut),
            "reversed": (cut, cut - 1), "beyond": (0, n + 1), "far": (n + 3, n + 7)}[kind]


def open_message(shape: PeerShape, sid: str, span, max_length: int, variant: str) -> OpenSession:
    sampling = {"sampling": SamplingParams(temperature=-1.0),
                "sampled": SamplingParams(temperature=0.8, top_k=7, top_p=0.9, seed=len(sid))}.get(variant,
                                                                                                SamplingParams())
    return OpenSession(version=PROTOCOL_VERSION + (variant == "version"),
                       model_id=shape.model_id + ("-other" if variant == "model" else ""), session_id=sid,
                       start=span[0], end=span[1], max_length=max_length, sampling=sampling)


def pool_used(sessions: list[Sess]) -> int:
    """Token-layers the peer's pool holds: every session's blocks, those keyed by content once
    per key (shared), the rest once per session."""
    used, shared = 0, {}
    for s in sessions:
        layers = s.end - s.start
        used += (s.held - len(s.keys) * BLOCK_SIZE) * layers
        for key in s.keys:
            shared[key] = BLOCK_SIZE * layers
    return used + sum(shared.values())


def shared_with_others(sess: Sess, sessions: list[Sess], b: int) -> bool:
    """Whether another session holds ``sess``'s keyed block ``b`` too (a write copies it)."""
    key = sess.keys[b]
    return any(o is not sess and b < len(o.keys) and o.keys[b] == key for o in sessions)


def whole_blocks(tokens: int) -> int:
    """``tokens`` rounded up to the peer's KV blocks."""
    return -(-tokens // BLOCK_SIZE) * BLOCK_SIZE


def opening_held(max_length: int) -> int:
    """Tokens per layer a session holds once opened: its headroom, in whole blocks."""
    return whole_blocks(min(max_length, HEADROOM_TOKENS))


def expect_open(shape: PeerShape, msg: OpenSession, open_ids: set, used: int) -> Optional[str]:
    """The error code the peer must answer ``msg`` with, or None: it opens the session."""
    if msg.version != PROTOCOL_VERSION:
        return "version_mismatch"
    if msg.model_id != shape.model_id:
        return "unknown_model"
    if not 0 <= msg.start < msg.end <= shape.num_layers:
        return "bad_request"  # the peer serves every layer, so this is never "range moved"
    if not 0 < msg.max_length <= shape.max_positions or msg.sampling.validate():
        return "bad_request"
    if msg.session_id in open_ids or not 0 < len(msg.session_id) <= 128:
        return "bad_request"  # an id open on *any* stream is taken
    need = opening_held(msg.max_length) * (msg.end - msg.start)
    if need > shape.capacity:
        return "bad_request"
    return "overloaded" if used + need > shape.capacity else None


def result_problem(reply, sess: Sess, step: int, q: int, k: int, shape: PeerShape) -> Optional[str]:
    """Why ``reply`` is not a well-formed ForwardResult for k positions at q, or None."""
    if not isinstance(reply, ForwardResult):
        return f"expected a ForwardResult, got {reply!r}"
    if reply.session_id != sess.sid or reply.step != step or reply.position != q + k:
        return f"result for {reply.session_id!r} step {reply.step} position {reply.position}, sent {sess.sid!r} " \
               f"step {step} position {q}+{k}"
    if sess.end == shape.num_layers:
        if reply.token is None or reply.tensor is not None or not 0 <= reply.token < shape.vocab_size:
            return f"the last span must return one token id in the vocabulary, got {reply!r}"
    elif reply.token is not None or reply.tensor is None or reply.tensor.dtype != "float32" \
            or list(reply.tensor.shape) != [k, shape.hidden_size]:
        return f"a span before the last must return float32 [{k}, {shape.hidden_size}], got {reply!r}"
    return None


def is_error(reply, code: str) -> bool:
    return isinstance(reply, ErrorReply) and reply.code == code


def close_enough(got: torch.Tensor, want: torch.Tensor) -> bool:
    """fp32 through the same weights, batched and chunked differently: equal to float noise."""
    return bool(torch.isfinite(got).all()) and torch.allclose(got, want, rtol=1e-3, atol=1e-3)


def finite_fraction(t: torch.Tensor) -> float:
    return float(torch.isfinite(t).float().mean()) if t.numel() else math.nan
