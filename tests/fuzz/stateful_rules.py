"""The Forward rules of the stateful peer test: honest, random and NaN inputs, requests the peer
must refuse, and several owners at once (so that their Forwards can share a compute step).

Each Forward is planned (frame bytes and what the peer must answer), sent, then checked against
the owner's model of its session (:class:`tests.fuzz.peer_model.Sess`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Optional

import msgspec
import torch
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from p2pserve.peer.kv_cache import BLOCK_SIZE
from p2pserve.protocol import Forward
from p2pserve.transport.frames import tensor_to_wire
from tests.fuzz.peer_driver import hidden_of, raw_frame
from tests.fuzz.peer_model import (SEEN, Owner, Sess, close_enough, is_error, result_problem, shared_with_others,
                                   whole_blocks)

#: What a refused Forward must be answered with (the session is left as it was).
INVALID = {"skip": "bad_request", "negative": "malformed", "dtype": "bad_request", "shape": "bad_request",
           "vocab": "bad_request", "empty": "bad_request", "length": "malformed", "foreign": "unknown_session",
           "unknown": "unknown_session", "overflow": "payload_too_large"}  # refused before its payload is read
HOW = ["honest", "honest", "honest", "random", "nan", "inf"]


@dataclass
class Planned:
    """One Forward on the wire and what must come back (``expect``: "result" or an error code)."""

    owner: Owner
    sess: Optional[Sess]
    step: int
    q: int
    k: int
    how: str
    frame: bytes
    expect: str = "result"
    kv: tuple[int, int] = (0, 0)  # tokens per layer the session holds after the rewind, and after growing
    may_overload: bool = False  # sent with others whose KV growth may take the blocks first
    names: list = field(default_factory=list)  # what each input row is (equal names, equal bytes)
    cow: bool = False  # the write lands in a block other sessions share: the peer copies it first


def settle(machine, expected_sessions: int, expected_used: int, timeout_s: float = 15.0) -> None:
    """Wait until the peer's counters agree with the owners' model (closes it notices on its own
    schedule: a stream that went away); AssertionError with the last figures if they never do."""
    want = (expected_sessions, machine.shape.capacity - expected_used)
    deadline = time.monotonic() + timeout_s
    while True:
        stats = machine.call(machine.env.monitor.stats())
        if (stats.sessions, stats.kv_free_token_layers) == want:
            return
        assert time.monotonic() < deadline, f"peer holds {stats.sessions} sessions / {stats.kv_free_token_layers} " \
                                            f"free token-layers, expected {want[0]} / {want[1]}"
        time.sleep(0.05)


class ForwardRules:
    """Mixin of the state machine's Forward rules (it provides owners, shape, ref, call)."""

    def _inputs(self, sess: Sess, q: int, k: int, how: str, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        if sess.start == 0:  # token ids: "random" ids are valid ones, just not the script's
            if how == "honest":
                return torch.tensor(self.ref.script[q:q + k], dtype=torch.int64)
            return torch.randint(0, self.shape.vocab_size, (k,), generator=gen)
        if how == "honest":
            return self.ref.hidden[sess.start][q:q + k].clone()
        x = torch.randn(k, self.shape.hidden_size, generator=gen)
        if how in ("nan", "inf"):
            x[seed % k, seed % self.shape.hidden_size] = float(how)
        return x

    def _plan(self, owner: Owner, sess: Sess, how: str, k: int, rewind: int, seed: int) -> Planned:
        p = sess.position
        q = p if rewind % 3 == 0 else p - rewind % (p + 1)  # a rewind to any cached position
        if how == "honest" and sess.taint is not None and rewind % 2:
            q = min(q, sess.taint)  # an owner that got garbage back replays from before it
        q = min(q, sess.max_length - 1)
        k = max(1, min(k, sess.max_length - q))
        if sess.start == 0 and how in ("nan", "inf"):
            how = "random"  # token ids cannot be NaN; valid random ids taint the cache the same way
        owner.step += 1
        meta, data = tensor_to_wire(self._inputs(sess, q, k, how, seed))
        msg = Forward(session_id=sess.sid, step=owner.step, position=q, tensor=meta)
        plan = Planned(owner, sess, owner.step, q, k, how, raw_frame(msgspec.msgpack.encode(msg), bytes(data)))
        # Paged KV: a rewind gives back the blocks past q, then the Forward takes blocks up to
        # q + k, or is refused "overloaded" (blocks untaken) when the pool lacks them.
        # NaN / inf hidden states are refused before either (``forward_checks``): nothing changes.
        if how in ("nan", "inf"):
            plan.kv = (sess.held, sess.held)
            return plan
        kept = min(sess.held, whole_blocks(q)) if q < sess.position else sess.held
        plan.kv = (kept, max(kept, whole_blocks(q + k)))
        plan.names = [("h", q + j) if how == "honest" else ("r", seed, k, j) for j in range(k)]
        # Prefix sharing: writing into a block shared with other sessions takes a copy with the growth.
        plan.cow = sess.writes_shared(q) and shared_with_others(sess, [s for _, s in self.open_sessions], q // BLOCK_SIZE)
        if self.used + (plan.kv[1] - sess.held + BLOCK_SIZE * plan.cow) * (sess.end - sess.start) > self.shape.capacity:
            plan.expect = "overloaded"
        return plan

    def _check(self, plan: Planned, reply, payload: bytes) -> None:
        sess, q, k = plan.sess, plan.q, plan.k
        if sess is not None and (plan.expect == "overloaded" or plan.may_overload and is_error(reply, "overloaded")):
            assert is_error(reply, "overloaded"), f"{plan.how} Forward: expected overloaded (KV full), got {reply!r}"
            sess.held, sess.position = plan.kv[0], min(sess.position, q)  # rewound, nothing grown
            sess.rewound(q)
            if sess.writes_shared(q) and not plan.cow:  # its sole holder let go of the block's key
                del sess.keys[q // BLOCK_SIZE:]
            SEEN["Forward refused: KV cache full"] += 1
            return
        if plan.expect != "result":
            assert is_error(reply, plan.expect), f"{plan.how} Forward: expected {plan.expect}, got {reply!r}"
            SEEN[f"refused {plan.how} Forward: {plan.expect}"] += 1
            return
        honest, clean = plan.how == "honest", sess.clean_below(q)
        problem = result_problem(reply, sess, plan.step, q, k, self.shape)
        if problem is not None:
            # only NaN/inf inputs (or a cache holding them) at the last layer may be refused: the
            # logits are not finite; finite inputs over a clean cache must be answered
            finite_over_clean = plan.how in ("honest", "random") and clean
            assert not finite_over_clean and is_error(reply, "bad_request"), f"{plan.how} at {q}: {problem}"
            sess.note(q, honest=False)  # the cache may have been filled before sampling failed
            if plan.how not in ("nan", "inf"):  # (those are refused before any KV moves)
                sess.held = min(plan.kv[1], whole_blocks(q))  # a failed job's positions are dropped
                sess.rewound(q)
                sess.wrote(q, plan.names)  # computed (its full blocks keyed), then dropped
                sess.rewound(q)
            SEEN[f"{plan.how} Forward refused (non-finite logits" + ("" if clean else " in the cache") + ")"] += 1
            return
        tainted_before = sess.taint is not None
        sess.position = q + k
        sess.held = plan.kv[1]
        sess.rewound(q)
        sess.wrote(q, plan.names)
        sess.note(q, honest)
        if not (honest and clean):
            SEEN[f"{plan.how} Forward answered" + ("" if clean else " (tainted cache)")] += 1
            return
        if sess.end == self.shape.num_layers and not sess.greedy:
            SEEN["honest sampled token in the vocabulary"] += 1
            return
        if sess.end == self.shape.num_layers:  # the honest owner's greedy token is the reference's
            assert self.ref.token_ok(reply.token, q + k - 1), \
                f"token {reply.token} at {q + k - 1}, reference {self.ref.top2[q + k - 1]} ({sess})"
        else:
            got, want = hidden_of(reply, payload), self.ref.hidden[sess.end][q:q + k]
            assert close_enough(got, want), f"hidden states after layer {sess.end} differ at {q}..{q + k} ({sess})"
        SEEN["honest " + ("token" if sess.end == self.shape.num_layers else "hidden states")
             + " equal to the reference" + (" after a rewind past tainted positions" if tainted_before else "")] += 1

    def _pick_session(self, pick: int) -> tuple[Owner, Sess]:
        pairs = self.open_sessions
        return pairs[pick % len(pairs)]

    @precondition(lambda self: self.open_sessions)
    @rule(pick=st.integers(0, 99), how=st.sampled_from(HOW), k=st.integers(1, 6), rewind=st.integers(0, 99),
          seed=st.integers(0, 2**16), decode=st.integers(0, 4))
    def forward(self, pick, how, k, rewind, seed, decode):
        """A prefill of k positions (maybe rewinding first), then up to ``decode`` single-token steps."""
        owner, sess = self._pick_session(pick)
        for i in range(1 + decode):
            plan = self._plan(owner, sess, how, k if i == 0 else 1, rewind if i == 0 else 0, seed + i)
            self._check(plan, *self.call(owner.conn.call_raw(plan.frame)))

    @precondition(lambda self: len({o.name for o, _ in self.open_sessions}) >= 2)
    @rule(picks=st.lists(st.integers(0, 99), min_size=2, max_size=3), hows=st.lists(st.sampled_from(HOW), min_size=3,
          max_size=3), k=st.integers(1, 4), seed=st.integers(0, 2**16))
    def concurrent(self, picks, hows, k, seed):
        """Owners' Forwards in flight together (they may share a step): each gets its own answer."""
        chosen: dict[str, tuple[Owner, Sess]] = {}
        for pick in picks:
            owner, sess = self._pick_session(pick)
            chosen.setdefault(owner.name, (owner, sess))
        plans = [self._plan(o, s, how, k, 0, seed + i) for i, ((o, s), how) in enumerate(zip(chosen.values(), hows))]
        growth = sum((p.kv[1] - p.sess.held) * (p.sess.end - p.sess.start) for p in plans)
        if self.used + growth > self.shape.capacity:  # who gets the last blocks depends on arrival order
            for p in plans:  # (one that alone overflows stays refused: the others only take blocks)
                p.may_overload = p.expect == "result"

        async def together():
            return await asyncio.gather(*(p.owner.conn.call_raw(p.frame) for p in plans))

        for plan, (reply, payload) in zip(plans, self.call(together())):
            self._check(plan, reply, payload)

    @precondition(lambda self: self.open_sessions)
    @rule(pick=st.integers(0, 99), seed=st.integers(0, 2**16))
    def abandon(self, pick, seed):
        """An owner sends a prefill and hangs up without reading the answer: the peer frees its
        sessions and keeps computing for everyone else."""
        owner, sess = self._pick_session(pick)
        plan = self._plan(owner, sess, "honest", sess.max_length, 1, seed)  # rewind to 0: the longest prefill

        async def send_and_leave():
            await owner.conn.send_raw(plan.frame)
            owner.conn.close()

        self.call(send_and_leave())
        self.owners.remove(owner)
        SEEN["abandoned a Forward in flight"] += 1
        settle(self, len(self.open_sessions), self.used)

    @precondition(lambda self: self.owners)
    @rule(pick=st.integers(0, 99), kind=st.sampled_from(sorted(INVALID)), seed=st.integers(0, 2**16))
    def forward_invalid(self, pick, kind, seed):
        """A Forward the peer must refuse with a typed error; the session it names stays as it was."""
        owner = self.owners[pick % len(self.owners)]
        mine = list(owner.sessions.values())
        theirs = [s for o, s in self.open_sessions if o is not owner]
        if kind == "foreign" and theirs:
            sess = theirs[pick % len(theirs)]
        elif kind not in ("foreign", "unknown") and mine:
            sess = mine[pick % len(mine)]
        else:
            kind, sess = "unknown", Sess(self.fresh_id(), 0, 1, 8, 0)
        if kind == "vocab" and sess.start > 0:
            kind = "shape"
        owner.step += 1
        plan = Planned(owner, None, owner.step, sess.position, 1, kind, self._invalid_frame(sess, kind, owner.step,
                                                                                              seed), INVALID[kind])
        self._check(plan, *self.call(owner.conn.call_raw(plan.frame)))

    def _invalid_frame(self, sess: Sess, kind: str, step: int, seed: int) -> bytes:
        q, H, V = min(sess.position, sess.max_length - 1), self.shape.hidden_size, self.shape.vocab_size
        k = sess.max_length - q + 1 if kind == "overflow" else 1
        ids = sess.start == 0
        inputs = self._inputs(sess, q, k, "honest", seed) if kind != "overflow" or ids else torch.zeros(k, H)
        if kind == "overflow" and ids:
            inputs = torch.tensor((self.ref.script * 20)[q:q + k], dtype=torch.int64)
        if kind == "dtype":
            inputs = inputs.float() if ids else inputs.half()
        elif kind == "shape":
            # ids as [1, 1], not [n], and hidden states one short of [1, H]: no more bytes than an
            # honest token, so the payload allowance (checked before the shape) cannot refuse it first
            inputs = torch.zeros(1, 1, dtype=torch.int64) if ids else torch.zeros(1, H - 1)
        elif kind == "vocab":
            inputs = torch.tensor([V if seed % 2 else -1], dtype=torch.int64)
        elif kind == "empty":
            inputs = inputs[:0]
        meta, data = tensor_to_wire(inputs)
        position = {"skip": 10**6, "negative": -1}.get(kind, q)
        header = msgspec.msgpack.encode(Forward(session_id=sess.sid, step=step, position=position, tensor=meta))
        payload = bytes(data)
        if kind == "length":
            payload = payload[:-3]  # the frame carries fewer bytes than the tensor header says
        return raw_frame(header, payload)
