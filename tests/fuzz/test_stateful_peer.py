"""One real peer process driven by random sequences of valid and invalid requests from several
owners: a Hypothesis state machine over real connections (the direct TCP path and
libp2p), against ``p2pserve peer`` serving a tiny Llama in fp32.

Invariants after every step: each reply is the one the peer's documented checks call for (a
typed ``ErrorReply`` with the expected code, or a well-formed result); an honest owner's greedy
tokens and hidden states equal the single-process reference, also right after someone else's
invalid or NaN request and after a rewind past its own; ``GetStats`` shows the compute thread
alive and never restarted, and the KV budget and session count the owners' model predicts
(all free once every session is closed).
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from p2pserve.client.model_info import LocalModelInfo
from p2pserve.protocol import CloseSession, SessionClosed, SessionOpened
from tests.fuzz import FUZZ, STATEFUL_EXAMPLES
from tests.fuzz.messages import requests
from tests.fuzz.mutate import hostile, streams
from tests.fuzz.peer_driver import Conn, LoopThread, Reference
from tests.fuzz.peer_model import (
    SEEN,
    opening_held,
    pool_used,
    SPANS,
    VARIANTS,
    Owner,
    PeerShape,
    Sess,
    expect_open,
    is_error,
    open_message,
    span_of,
)
from tests.fuzz.stateful_rules import ForwardRules, settle
from tests.harness import client_node, start_peers

pytestmark = pytest.mark.integration

LAYERS = 8
KV_TOKEN_LAYERS = LAYERS * 64  # 4 blocks of 16 per layer: full-span sessions run out of KV blocks
VALID_SPANS = ["full", "head", "mid", "tail"]
VALID_LENGTHS = [1, 8, 24, 40]
#: One fault per invalid open: a span, a max_length (0; 64, which opens: a session takes KV blocks
#: as it grows; 513 > the model's positions), a session id, or the model / version / sampling.
OPEN_FAULTS = ["empty", "reversed", "beyond", "far", 0, 64, 513, "own", "other", "long", "empty-id",
               "model", "version", "sampling"]


@dataclass
class Env:
    """What every example shares: the peer, the client loop and transport, the reference."""

    peer: object
    loop: LoopThread
    transport: object
    monitor: Conn
    shape: PeerShape
    ref: Reference


class PeerMachine(ForwardRules, RuleBasedStateMachine):
    """Owners opening, using, abusing and closing sessions on one peer (see the module docstring)."""

    env: Env = None
    _ids = itertools.count()

    def __init__(self):
        super().__init__()
        self.owners: list[Owner] = []
        self.call = self.env.loop.call
        self.shape, self.ref = self.env.shape, self.env.ref
        settle(self, expected_sessions=0, expected_used=0)  # each example starts on an idle peer
        SEEN["examples"] += 1

    # ------------------------------------------------------------------ the owners' view
    @property
    def open_sessions(self) -> list[tuple[Owner, Sess]]:
        return [(o, s) for o in self.owners for s in o.sessions.values()]

    @property
    def used(self) -> int:
        return pool_used([s for _, s in self.open_sessions])

    def fresh_id(self) -> str:
        return f"fz{next(self._ids)}"

    # ------------------------------------------------------------------ connections
    @initialize(kinds=st.lists(st.sampled_from(VALID_SPANS), min_size=2, max_size=2), seed=st.integers(0, 999),
                max_length=st.sampled_from([8, 24]))
    def two_owners(self, kinds, seed, max_length):
        """Start where the interesting steps are: two owners (direct and libp2p), a session each."""
        for direct, kind in zip((True, False), kinds):
            self.connect(direct)
            self._open(self.owners[-1], kind, seed, max_length, "fresh", "ok")

    @precondition(lambda self: len(self.owners) < 3)
    @rule(direct=st.booleans())
    def connect(self, direct):
        conn = self.call(Conn.open(self.env.transport, self.env.peer, direct))
        self.owners.append(Owner(f"owner{next(self._ids)}", conn, direct))

    @precondition(lambda self: self.owners)
    @rule(pick=st.integers(0, 99))
    def disconnect(self, pick):
        """The peer frees every session of a stream that went away."""
        self.owners.pop(pick % len(self.owners)).conn.close()
        settle(self, len(self.open_sessions), self.used)

    # ------------------------------------------------------------------ sessions
    @precondition(lambda self: self.owners)
    @rule(pick=st.integers(0, 99), kind=st.sampled_from(VALID_SPANS), seed=st.integers(0, 999),
          max_length=st.sampled_from(VALID_LENGTHS), sampled=st.booleans())
    def open_session(self, pick, kind, seed, max_length, sampled):
        """An honest open, greedy or sampled: it succeeds unless the KV budget is spent ("overloaded")."""
        self._open(self.owners[pick % len(self.owners)], kind, seed, max_length, "fresh",
                   "sampled" if sampled else "ok")

    @precondition(lambda self: self.owners)
    @rule(pick=st.integers(0, 99), fault=st.sampled_from(OPEN_FAULTS), seed=st.integers(0, 999))
    def open_session_invalid(self, pick, fault, seed):
        """An open with one thing wrong: a bad span, length, id, model, version or sampling."""
        kind, max_length, sid, variant = "full", 8, "fresh", "ok"
        if fault in SPANS:
            kind = fault
        elif isinstance(fault, int):
            max_length = fault
        elif fault in VARIANTS:
            variant = fault
        else:
            sid = fault
        self._open(self.owners[pick % len(self.owners)], kind, seed, max_length, sid, variant)

    def _open(self, owner: Owner, kind: str, seed: int, max_length: int, sid: str, variant: str) -> None:
        taken = {s.sid: o for o, s in self.open_sessions}
        mine = [k for k, o in taken.items() if o is owner]
        theirs = [k for k, o in taken.items() if o is not owner]
        sid = {"own": mine[0] if mine else self.fresh_id(), "other": theirs[0] if theirs else self.fresh_id(),
               "long": "x" * 129, "empty-id": ""}.get(sid, self.fresh_id())
        msg = open_message(self.shape, sid, span_of(kind, seed, LAYERS), max_length, variant)
        code = expect_open(self.shape, msg, set(taken), self.used)
        reply, _ = self.call(owner.conn.call(msg))
        if code is not None:
            assert is_error(reply, code), f"{msg!r}: expected {code}, got {reply!r}"
            SEEN[f"open refused: {code}"] += 1
            return
        assert isinstance(reply, SessionOpened), f"{msg!r}: got {reply!r}"
        assert (reply.session_id, reply.start, reply.end, reply.served_start, reply.served_end) == \
            (sid, msg.start, msg.end, 0, LAYERS)
        assert reply.hidden_size == self.shape.hidden_size and reply.dtype == "float32"
        SEEN[f"opened {kind} span"] += 1
        owner.sessions[sid] = Sess(sid, msg.start, msg.end, msg.max_length, opening_held(msg.max_length),
                                   greedy=msg.sampling.temperature == 0.0)

    @precondition(lambda self: self.owners)
    @rule(pick=st.integers(0, 99), which=st.sampled_from(["own", "own", "closed", "other", "unknown"]))
    def close_session(self, pick, which):
        """Closing frees the KV of one's own session only; any other id is unknown to this stream."""
        owner = self.owners[pick % len(self.owners)]
        others = [s.sid for o, s in self.open_sessions if o is not owner]
        if which == "own" and owner.sessions:
            sid = next(iter(owner.sessions))
        else:
            pool = {"closed": owner.closed, "other": others}.get(which) or [self.fresh_id()]
            sid = pool[pick % len(pool)]
        reply, _ = self.call(owner.conn.call(CloseSession(session_id=sid)))
        SEEN[f"close {which}"] += 1
        if sid in owner.sessions:
            assert reply == SessionClosed(session_id=sid), reply
            del owner.sessions[sid]
            owner.closed.append(sid)
        else:
            assert is_error(reply, "unknown_session"), f"closing {sid!r} ({which}): {reply!r}"

    # ------------------------------------------------------------------ hostile bytes
    @rule(data=streams(hostile(requests)), direct=st.booleans())
    def garbage(self, data, direct):
        """Random and mutated frames on a throwaway stream: every reply is typed, nobody else notices."""
        conn = self.call(Conn.open(self.env.transport, self.env.peer, direct))
        try:
            for reply, _ in self.call(_replies_to(conn, data)):
                SEEN[f"garbage answered {type(reply).__name__} {getattr(reply, 'code', '')}".strip()] += 1
        finally:
            conn.close()
        settle(self, len(self.open_sessions), self.used)  # what the garbage opened is freed with its stream

    # ------------------------------------------------------------------ health
    @invariant()
    def peer_is_healthy(self):
        SEEN["steps"] += 1
        st_ = self.call(self.env.monitor.stats())
        assert st_.compute_alive and st_.compute_restarts == 0, st_
        assert st_.kv_capacity_token_layers == self.shape.capacity
        assert (st_.sessions, st_.kv_free_token_layers) == (len(self.open_sessions), self.shape.capacity - self.used), \
            f"peer holds {st_.sessions} sessions / {st_.kv_free_token_layers} free; owners hold " \
            f"{len(self.open_sessions)} / {self.shape.capacity - self.used}"

    def teardown(self):
        for owner in self.owners:
            owner.conn.close()
        self.owners = []
        settle(self, expected_sessions=0, expected_used=0)  # all closed: the whole budget is free


async def _replies_to(conn: Conn, data: bytes) -> list:
    """Send ``data``, then collect replies until the peer goes quiet or ends the stream."""
    await conn.send_raw(data)
    out = []
    while True:
        try:
            out.append(await conn.reply(timeout_s=0.5))
        except (TimeoutError, ConnectionError, OSError):
            return out
        except Exception as e:  # noqa: BLE001 - the end of the stream, told apart from a bad reply
            if type(e).__name__ == "IncompleteReadError":
                return out
            raise


@pytest.fixture(scope="module")
def env(model_dir):
    path = model_dir("llama")
    (peer,) = start_peers(path, [(0, LAYERS)], "--dtype", "float32", "--kv-token-layers", str(KV_TOKEN_LAYERS),
                          "--session-idle-timeout", "600", "--max-payload-mb", "1",
                          # the owners' model predicts one shared budget (the quotas: tests/integration/test_peer_bounds.py)
                          "--max-kv-fraction-per-owner", "1", "--max-sessions-per-owner", "1024")
    loop = LoopThread()
    nodes = client_node()
    try:
        transport = loop.call(nodes.__aenter__())
        monitor = loop.call(Conn.open(transport, peer, direct=True))
        model = LocalModelInfo.load(path)
        spec = model.spec
        prompt = model.chat_ids([{"role": "user", "content": "Tell me about hostile bytes."}])[:12]
        ref = Reference.build(path, prompt, new_tokens=48)
        shape = PeerShape(spec.model_id, spec.num_layers, spec.hidden_size, spec.vocab_size,
                          spec.max_position_embeddings, loop.call(monitor.stats()).kv_capacity_token_layers)
        yield Env(peer, loop, transport, monitor, shape, ref)
    finally:
        try:
            loop.call(nodes.__aexit__(None, None, None))
        finally:
            loop.stop()
            peer.stop()


def test_one_peer_under_random_owners(env):
    PeerMachine.env = env
    run_state_machine_as_test(PeerMachine, settings=settings(FUZZ, max_examples=STATEFUL_EXAMPLES,
                                                             stateful_step_count=15))
    env.peer.check()  # the process is still running
    print("stateful runs exercised:", dict(sorted(SEEN.items())))
    report = os.environ.get("P2PSERVE_FUZZ_STATEFUL_REPORT")
    if report:  # for benchmarks/fuzz.py
        seen = dict(SEEN)
        Path(report).write_text(json.dumps({"examples": seen.pop("examples", 0), "steps": seen.pop("steps", 0),
                                            "seen": dict(sorted(seen.items()))}, indent=2))

