"""The peer's session table: admission against the KV pool, idle expiry, explicit close.

A session holds the pool's blocks its tokens fill (`PagedCache`), plus, from the moment it
opens, a headroom of ``HEADROOM_TOKENS`` per layer so an admitted session can always start; it
takes more as it grows (`SessionTable.grow`, before each Forward runs) and is refused with
OverloadedError ("KV cache full") when the pool has no more.

Pure bookkeeping with an injected clock; the compute worker owns the tensors inside each
session's cache, the asyncio handlers own this table.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from p2pserve.config import AdmissionConfig
from p2pserve.dht.evidence import InputChain
from p2pserve.errors import BadRequestError, OverloadedError, P2PServeError, RangeMovedError, SessionNotFoundError
from p2pserve.model.spec import ModelSpec
from p2pserve.peer.admission import check_kv_share, check_session_quota
from p2pserve.peer.kv_cache import KVBudget, PagedCache
from p2pserve.peer.prefix_share import scope_salt
from p2pserve.protocol import OpenSession, SamplingParams
from p2pserve.types import SessionId


@dataclass
class Session:
    """One client's session on this peer: its span, its cache and its position counter.

    The peer counts positions itself: a peer without layer 0 cannot infer them from token ids.
    """

    id: str
    start: int
    end: int
    max_length: int
    sampling: SamplingParams
    cache: PagedCache
    owner: object  # the stream that opened it; closed together with it
    last_used: float
    principal: str = ""  # the remote peer id behind that stream: per-owner quotas count by it
    job: object = None  # the Forward the compute worker holds for it (one at a time), or None
    closed: bool = False  # closed while a job ran: the reservation is released when it settles
    chain: InputChain = field(default_factory=InputChain)  # commitment to every input consumed (signed replies)
    background: bool = False  # its Forwards run only in spare steps (OpenSession.background)
    # Last hop: the token ids at positions [0, len) the client sent as ``Forward.context``
    # (the history that penalties and prompt log-probabilities read).
    tokens: list[int] = field(default_factory=list)

    @property
    def position(self) -> int:
        return self.cache.length

    @property
    def reserved(self) -> int:
        """Token-layers of the KV pool this session holds now."""
        return self.cache.held

    @property
    def busy(self) -> bool:
        """Whether the compute worker holds a job of this session (queued or running)."""
        return self.job is not None


@dataclass
class SessionTable:
    """Open sessions of one peer, keyed by session id; each usable only by the stream that opened it."""

    spec: ModelSpec
    served: tuple[int, int] | None  # None while the peer serves no layers yet
    budget: KVBudget
    idle_timeout_s: float
    max_sessions: int = 1024
    clock: Callable[[], float] = time.monotonic
    torch_dtype: object = None
    device: str = "cpu"
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    _sessions: dict[str, Session] = field(default_factory=dict)
    # Closed sessions remembered for their owner's error messages only, keyed by id, holding the
    # owner's id() (not the stream itself, which may be gone by then).
    _expired: OrderedDict = field(default_factory=OrderedDict)  # recently expired: id -> (time, owner id)
    _moved: OrderedDict = field(default_factory=OrderedDict)  # closed because the range moved: id -> owner id
    #: Sessions closed so far, for any reason: whoever keeps state per open session looks for
    #: closed ones only when this moved (``Forwarder``: each request would otherwise scan all).
    closes: int = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, msg: OpenSession, owner: object, principal: str = "") -> Session:
        """Validate an OpenSession and reserve its KV; raises a typed error when it cannot.

        ``owner`` is the stream (the session is bound to it), ``principal`` the peer id behind
        it, whose sessions and KV together are held to ``admission``'s per-owner quota.
        """
        if self.served is None:
            raise RangeMovedError("this peer serves no layers yet (waiting for the plan / loading)")
        lo, hi = self.served
        if not (lo <= msg.start < msg.end <= hi):
            where = f"layers [{msg.start}, {msg.end}) are outside this peer's range [{lo}, {hi})"
            if not (0 <= msg.start < msg.end <= self.spec.num_layers):
                raise BadRequestError(f"{where}; the model has {self.spec.num_layers} layers")
            # Layers the model has, sent to a peer that does not hold them: the client's view of
            # the swarm is stale (this peer flipped to a new range after the plan it routes by was
            # published). Another route can serve it, so the error is the retriable kind.
            raise RangeMovedError(f"{where}; the route is stale, take another")
        if msg.max_length <= 0 or msg.max_length > self.spec.max_position_embeddings:
            raise BadRequestError(
                f"max_length must be in [1, {self.spec.max_position_embeddings}], got {msg.max_length}"
            )
        reason = msg.sampling.validate()
        if reason:
            raise BadRequestError(reason)
        if msg.session_id in self._sessions:
            raise BadRequestError(f"session {msg.session_id!r} is already open")
        if not msg.session_id or len(msg.session_id) > 128:
            raise BadRequestError("session_id must be 1..128 characters")
        if len(self._sessions) >= self.max_sessions:
            raise OverloadedError(f"this peer already holds {self.max_sessions} sessions")
        headroom = min(msg.max_length, HEADROOM_TOKENS)
        B = self.budget.block_size
        need = -(-headroom // B) * B * (msg.end - msg.start)
        held = [s for s in self._sessions.values() if s.principal == principal]
        check_session_quota(self.admission, self.budget.capacity, len(held), sum(s.reserved for s in held), need)
        heads, k_dim, v_dim = self.spec.kv_layout
        self.budget.bind(heads, k_dim, self.torch_dtype, self.device, v_dim=v_dim)
        parent = self._fork_parent(msg, principal)
        cache = self._cache(msg, principal, parent, headroom)
        session = Session(
            id=msg.session_id,
            start=msg.start,
            end=msg.end,
            max_length=msg.max_length,
            sampling=msg.sampling,
            cache=cache,
            owner=owner,
            last_used=self.clock(),
            principal=principal,
            background=msg.background,
        )
        if parent is not None:  # what the parent consumed at [0, fork_at) is this one's past too
            session.chain.links = parent.chain.links[: msg.fork_at + 1]
            session.tokens = parent.tokens[: msg.fork_at]
        self._sessions[msg.session_id] = session
        return session

    def _cache(self, msg: OpenSession, principal: str, parent: Session | None, headroom: int) -> PagedCache:
        """A new session's cache holding ``headroom`` positions' blocks (and ``parent``'s first
        ``msg.fork_at`` positions, when it forks one); OverloadedError ("KV cache full") when the
        pool lacks them, nothing taken."""
        cache = PagedCache(self.budget, msg.start, msg.end, msg.max_length,
                           scope_salt(self.admission.prefix_sharing, principal))
        if parent is not None:
            cache.fork(parent.cache, msg.fork_at)
        try:
            cache.reserve(max(headroom, msg.fork_at))
        except BaseException:
            cache.release()
            raise
        return cache

    def _fork_parent(self, msg: OpenSession, principal: str) -> Session | None:
        """The session ``msg`` forks (``OpenSession.fork_of``), or None; BadRequestError when it
        cannot be forked, saying the same whether it does not exist or is someone else's."""
        if msg.fork_of is None:
            return None
        parent = self._sessions.get(msg.fork_of)
        if parent is None or parent.closed or parent.principal != principal:
            raise BadRequestError(f"no session {msg.fork_of!r} of yours to fork")
        if (parent.start, parent.end) != (msg.start, msg.end) or not 0 < msg.fork_at <= parent.position:
            raise BadRequestError(f"cannot fork positions [0, {msg.fork_at}) of layers [{parent.start}, "
                                  f"{parent.end}) holding {parent.position} into [{msg.start}, {msg.end})")
        if parent.busy or msg.fork_at > msg.max_length:
            raise BadRequestError("the session to fork is running a step, or longer than max_length")
        if parent.chain.length < msg.fork_at:
            raise BadRequestError("the session to fork has not committed its inputs")
        return parent

    def grow(self, session: Session, length: int) -> None:
        """Before a Forward runs: hold blocks for ``length`` tokens, or OverloadedError ("KV cache
        full", nothing taken) when the pool lacks them, or when ``session``'s owner would pass its
        share of the pool (``admission.max_kv_fraction_per_owner``)."""
        B = self.budget.block_size
        more = max(0, -(-length // B) * B * (session.end - session.start) - session.reserved)
        if more:
            held = sum(s.reserved for s in self._sessions.values() if s.principal == session.principal)
            check_kv_share(self.admission, self.budget.capacity, held, more)
        session.cache.reserve(length)

    def get(self, session_id: SessionId, owner: object) -> Session:
        """The open session with this id opened by ``owner``, or SessionNotFoundError.

        A session is bound to the stream that opened it: for any other owner it does not exist,
        and the error says no more than for an id never opened (whether it expired or moved is
        told to its owner only).
        """
        session = self._sessions.get(session_id)
        if session is None or session.owner is not owner:
            if session is None and self._moved.get(session_id) == id(owner):
                raise RangeMovedError(
                    f"session {session_id!r} was closed: this peer moved to layers {self.served}; replay elsewhere"
                )
            if session is None and session_id in self._expired and self._expired[session_id][1] == id(owner):
                raise SessionNotFoundError(
                    f"session {session_id!r} expired after {self.idle_timeout_s:.0f} s idle; open a new one"
                )
            raise SessionNotFoundError(f"unknown session {session_id!r}; open it first")
        session.last_used = self.clock()
        return session

    def closed_error(self, session: Session) -> P2PServeError:
        """What ``session``'s owner is told of it once it is no longer open here (range moved,
        expired, or closed), as :meth:`get` would tell it."""
        try:
            self.get(session.id, session.owner)
        except (RangeMovedError, SessionNotFoundError) as e:
            return e
        return SessionNotFoundError(f"session {session.id!r} was closed")

    def close(self, session_id: SessionId, owner: object) -> None:
        """Close ``owner``'s session and free its KV reservation; SessionNotFoundError as :meth:`get`."""
        self.get(session_id, owner)
        self._drop(session_id)

    def _drop(self, session_id: SessionId) -> Session | None:
        """Remove a session whoever owns it and release its reservation; the session, if it was open.

        While the worker holds a job of the session, its cache may still be written: the
        reservation is released when that job settles (:meth:`settle`), never before.
        """
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self.closes += 1
            session.closed = True
            if session.job is None:
                session.cache.release()
        return session

    def settle(self, job) -> None:
        """The compute worker is done with ``job`` (ran, failed or dropped): its session may take
        the next Forward, and a session closed meanwhile gives its reservation back now.

        Called on the event loop's thread when the job's result is delivered, whether or not
        anybody still awaits it (a handler that timed out does not).
        """
        session: Session = job.session
        if session.job is not job:
            return
        session.job = None
        session.last_used = self.clock()
        if session.closed:
            session.cache.release()

    def close_owned_by(self, owner: object) -> int:
        """Close every session opened on a stream that went away; returns how many."""
        ids = [s.id for s in self._sessions.values() if s.owner is owner]
        for sid in ids:
            self._drop(sid)
        # Forget its closed sessions too: a later stream may reuse the id() they are keyed by.
        for sid in [k for k, v in self._moved.items() if v == id(owner)]:
            del self._moved[sid]
        for sid in [k for k, (_, who) in self._expired.items() if who == id(owner)]:
            del self._expired[sid]
        return len(ids)

    def retarget(self, served: tuple[int, int] | None) -> list[str]:
        """Switch to a new served range; close sessions whose span is no longer served."""
        self.served = served
        gone = [
            s.id for s in self._sessions.values()
            if served is None or not (served[0] <= s.start and s.end <= served[1])
        ]
        for sid in gone:
            self._moved[sid] = id(self._drop(sid).owner)
        _bound(self._moved)
        return gone

    def expire_idle(self) -> list[str]:
        """Close sessions idle longer than the timeout (never one with a request in flight)."""
        now = self.clock()
        stale = [
            s.id for s in self._sessions.values() if not s.busy and now - s.last_used > self.idle_timeout_s
        ]
        for sid in stale:
            self._expired[sid] = (now, id(self._drop(sid).owner))
        _bound(self._expired)
        return stale


#: Tokens per layer a session holds from the moment it opens (rounded up to whole blocks), so
#: that an admitted session can always run its first step: one block at the default block size.
HEADROOM_TOKENS = 16

#: Closed sessions remembered for their owners' error messages; the oldest are forgotten first.
REMEMBERED = 4096


def _bound(memory: OrderedDict) -> None:
    while len(memory) > REMEMBERED:
        memory.popitem(last=False)
