"""Re-execution of sampled steps on another replica, off the critical path; verdicts; evidence.

After each successful step, :meth:`Verifier.after_step` draws, per hop, whether to verify it
(``ClientConfig.verify_share``; with ``verify_every_request`` every hop is checked). A drawn hop
is checked by a background task, never by the user's request (unless it holds for it,
``verify_hold``), once its route is done, covering all its steps:

1. the reply's signature is checked against the peer's announced ``reply_key`` (a bad one bans
   the peer locally at once: it is malformed, there is nothing to prove);
2. a *witness* (another peer serving the hop's layers) gets the hop's whole input history.
   For hidden states one prefill returns every position, and all of the hop's steps so far are
   compared with what it returned (within :data:`TOLERANCE` of its dtype); for the last hop the
   replay asks for the token after each position the hop returned one for, at most
   ``MAX_VERIFY_OUTPUTS`` per Forward (:func:`token_windows`), and every token is compared,
   the tokens of speculative steps (several positions each) among them: those after the rows
   the client kept (``Step.tokens_kept``; a draft's rejected rows were rewound and the tokens
   after them were never used);
3. on a difference the first differing step is replayed *aligned* (history as a prefill, then
   exactly that step) on the witness and on a third replica, each signing its claim over the same
   inputs. Whoever disagrees with both others is the culprit; with no third replica, or three
   different answers, the verdict is "inconclusive" (logged, nobody blamed).

A culprit is banned by this client at once and, when the client is in a swarm, listed in its
:class:`~p2pserve.dht.evidence.Evidence` record with every signed claim. Pure parts:
:func:`distance`, :func:`culprit`, :func:`token_windows`. The witness runs a check as background
work (``OpenSession.background``): only in its spare compute steps.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from dataclasses import dataclass, field, replace
from typing import Awaitable, Callable, Optional

import torch

from p2pserve.client.hop import Hop
from p2pserve.client.routing import Masks
from p2pserve.client.trust.session import VerifiedSession
from p2pserve.client.trust.tape import HopTape, join, reply_output_digest
from p2pserve.client.trust.witness_pool import WitnessPool
from p2pserve.config import ClientConfig
from p2pserve.dht.claim_extras import extras_digest, returned_digest
from p2pserve.dht.evidence import (
    MAX_HISTORY_BYTES,
    MAX_INPUT_BYTES,
    MAX_OUTPUT_BYTES,
    TOLERANCE,
    Mismatch,
    ReplyClaim,
    SignedClaim,
    make_claim,
    verify_claim,
)
from p2pserve.protocol import MAX_VERIFY_OUTPUTS, SamplingParams, TensorMeta
from p2pserve.transport.frames import tensor_from_wire
from p2pserve.client.trust.verdict import culprit, distance, row_distances

log = logging.getLogger(__name__)


@dataclass
class Answer:
    """A replica's aligned replay of one step: its signed claim and output."""

    hop: Hop
    claim: ReplyClaim
    signature: bytes
    token: Optional[int | tuple]  # a token, or a speculative step's tokens (a tuple)
    hidden: Optional[torch.Tensor]  # [count, hidden] (None from the last layers)
    output: bytes = b""  # the raw output bytes (hidden states), as signed

    @property
    def answer(self) -> tuple:
        """(token, hidden states) as :func:`_agree` compares them."""
        return self.token, self.hidden


@dataclass
class VerifyStats:
    """What this client's verifier did."""

    sampled: int = 0
    verified: int = 0  # steps compared against a witness (each hidden step of a screen counts)
    verified_speculative: int = 0  # of which the last hop's speculative steps
    skipped: int = 0  # sampled, but no replica, or too many checks in flight
    mismatches: int = 0
    inconclusive: int = 0
    bad_signatures: int = 0
    max_distance: dict = field(default_factory=dict)  # dtype -> largest honest distance seen


class Verifier:
    """One client's verifier, shared by its pipelines (like its bans).

    ``replicas(start, end, exclude)`` lists other hops serving [start, end); ``reply_key(peer)``
    its announced key ("" unknown: signatures are then not checked and no evidence is made);
    ``publish(cases)`` announces this client's evidence (None: local bans only).
    """

    def __init__(self, transport, model_id: str, num_layers: int, config: ClientConfig,
                 replicas: Callable[[int, int, frozenset], list[Hop]], reply_key: Callable[[str], str],
                 publish: Optional[Callable[[list[Mismatch]], Awaitable[None]]] = None, seed: Optional[int] = None,
                 dtype: str = "float32"):
        self.transport = transport
        self.model_id = model_id
        self.dtype = dtype  # the model's compute dtype: what the peers sign their claims in
        self.num_layers = num_layers
        self.config = config
        self.replicas = replicas
        self.reply_key = reply_key
        self.publish = publish
        self.rng = random.Random(seed)
        self.stats = VerifyStats()
        self.excluded: dict[str, str] = {}  # peer id -> why this client stopped using it
        self.cases: dict[str, Mismatch] = {}  # accused peer id -> the latest mismatch proven
        self._tasks: set[asyncio.Task] = set()
        self.witnesses = WitnessPool(transport, model_id, num_layers, config)  # streams and sessions on replicas

    def session(self) -> VerifiedSession:
        """A pipeline's view of this verifier (its ``StepTrust``)."""
        return VerifiedSession(self, tape_steps=self.config.verify_share > 0)

    def masks(self, masks: Masks) -> Masks:
        """``masks`` with the peers this client caught added to the banned ones."""
        return replace(masks, banned=masks.banned | frozenset(self.excluded)) if self.excluded else masks

    def after_step(self, tapes: list[HopTape], sampling: SamplingParams, suspects=None) -> None:
        """Draw which hops of the step just done to verify; ``suspects`` (the pipeline's
        ``client.trust.rollback.Suspects``) learns who touched the step's outputs.

        A drawn hop is marked due and checked once, when the route is done (:meth:`route_done`): one
        replay of its history then covers every step, however many were drawn (for the last hop,
        every token among the last ``MAX_VERIFY_OUTPUTS`` positions, asked for in one Forward).
        Checking at each draw would replay a long session's history again and again (quadratic in
        its length), and a last hop's check at each draw cost two Forwards for one token.
        """
        if suspects is not None:
            suspects.stepped(tapes)
        every = self.config.verify_every_request
        for tape in tapes:
            if (self.rng.random() >= self.config.verify_share and not every) or tape.last is None:
                continue
            self.stats.sampled += 1
            tape.due = sampling

    def route_done(self, tapes: list[HopTape], suspects=None) -> None:
        """The pipeline leaves these hops (request done, or failover): check those marked due
        (the tasks started join the pipeline's ``suspects.checks``, see ``client/trust/rollback.py``)."""
        for tape in tapes:
            if tape.due is not None and tape.last is not None:
                self._start(tape, tape.due, suspects.checks if suspects is not None else None)
            tape.due = None

    def _start(self, tape: HopTape, sampling: SamplingParams, checks: Optional[set] = None) -> None:
        """Check ``tape`` as it is now in a background task, unless too many checks run already."""
        if len(self._tasks) >= self.config.verify_max_inflight and not self.config.verify_every_request:
            self.stats.skipped += 1
            return
        snapshot = HopTape(tape.hop, tape.session_id, list(tape.steps))  # later steps must not leak in
        task = asyncio.create_task(self._guarded(snapshot, sampling))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if checks is not None:
            checks.add(task)
            task.add_done_callback(checks.discard)

    async def drain(self) -> None:
        """Wait for the checks under way (tests, benchmarks, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Cancel the checks under way (the client is leaving)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self.witnesses.close()

    async def _guarded(self, tape: HopTape, sampling: SamplingParams) -> None:
        try:
            await self.check(tape, sampling)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a witness that failed is no verdict on the accused
            self.stats.skipped += 1
            log.info("verification of %s skipped: %s: %s", tape.hop, type(e).__name__, e)

    async def check(self, tape: HopTape, sampling: SamplingParams) -> Optional[str]:
        """Verify the latest step of ``tape``; returns the culprit's peer id if one was proven."""
        hop, step = tape.hop, tape.last
        key = self.reply_key(hop.peer_id)
        if key and not verify_claim(key, self._claim(tape, step, sampling), step.reply.signature):
            self.stats.bad_signatures += 1
            self._exclude(hop.peer_id, "reply signature does not verify")
            return hop.peer_id
        others = self.replicas(hop.start, hop.end, frozenset({hop.peer_id}) | frozenset(self.excluded))
        if not others:
            self.stats.skipped += 1
            return None
        others = self.rng.sample(others, min(2, len(others)))
        bad = await self._first_difference(tape, others[0], sampling)
        if bad is None:
            return None
        return await self._settle(tape, bad, others, sampling)

    def _claim(self, tape: HopTape, step, sampling: SamplingParams) -> ReplyClaim:
        chunk = step.inputs
        return make_claim(model=self.model_id, peer_id=tape.hop.peer_id, session_id=tape.session_id,
                          start=tape.hop.start, end=tape.hop.end, position=chunk.position, count=chunk.count,
                          commitment=tape.commitment_of(step), output=reply_output_digest(step.reply, step.output),
                          kind=_kind(step.reply), dtype=self.dtype, sampling=sampling,
                          extras=_extras(tape, step, sampling), returned=_returned(step.reply))

    async def _first_difference(self, tape: HopTape, witness: Hop, sampling: SamplingParams):
        """The first step of ``tape`` (as signed: a head's whole step) whose output on rows still
        on the tape the witness does not reproduce, or None."""
        step = tape.last
        done = [s for s in tape.steps if s.signed is not None]
        end = step.inputs.position + step.inputs.count
        payload, rows = join(tape.inputs_before(end))
        if tape.hop.end == self.num_layers:
            return await self._first_token_difference(tape, witness, sampling, end, payload, rows)
        replies, _ = await self._run(witness, [(0, rows, step.inputs.dtype, payload, 1)], end, sampling)
        theirs = _rows(replies[-1][0].tensor, replies[-1][1])
        tol = TOLERANCE.get(_dtype(step), 1e-3)
        # One distance over every row of every step, a handful of torch calls whatever the
        # session's length: a call per step cost the client more CPU than the check's Forward.
        first = done[0].signed.reply.tensor
        data = b"".join(bytes(s.output_kept()) for s in done)
        rows_of = [s.inputs.count for s in done]
        ours = _rows(TensorMeta(first.dtype, [sum(rows_of), *first.shape[1:]], len(data)), data)
        at = torch.tensor([p for s in done for p in range(s.inputs.position, s.inputs.position + s.inputs.count)])
        per_row = row_distances(ours, theirs[at]).tolist()
        offsets = [0] + list(itertools.accumulate(rows_of))
        for i, s in enumerate(done):
            d = max(per_row[offsets[i]:offsets[i + 1]])
            self.stats.verified += 1
            if d > tol:
                return s.signed
            key = _dtype(s.signed)
            self.stats.max_distance[key] = max(self.stats.max_distance.get(key, 0.0), d)
        return None

    async def _first_token_difference(self, tape: HopTape, witness: Hop, sampling: SamplingParams, end: int,
                                      payload: bytes, rows: int):
        """The last hop's first step (as signed: a speculative head's whole step) with a token
        the witness does not reproduce. The history is replayed in Forwards that ask for the token
        after each position from the first one a step returned a token after, at most
        ``MAX_VERIFY_OUTPUTS`` per Forward (peers sample with a seed per position), so every
        token the hop returned after a position still on the tape is compared."""
        kept = [(s, s.tokens_kept()) for s in tape.steps]
        kept = [(s, pairs) for s, pairs in kept if pairs]
        if not kept:
            return None
        first = kept[0][1][0][0]
        if tape.extras:  # each step as the hop got it: its own context and mask (one token each)
            calls = [(s.inputs.position, s.inputs.count, s.inputs.dtype, s.inputs.data, 1, s.inputs.context,
                      s.allowed) for s in tape.steps]
        else:
            calls = token_windows(first, end, rows, tape.last.inputs.dtype, payload)
        replies, _ = await self._run(witness, calls, end, sampling)
        theirs: dict[int, int] = {}  # position -> the witness's token after it
        for (position, n, _, _, k, *_), (reply, _) in zip(calls, replies):
            tokens = reply.tokens if k > 1 else [reply.token]
            theirs.update(zip(range(position + n - k, position + n), tokens))
        for s, pairs in kept:
            self.stats.verified += 1
            self.stats.verified_speculative += s.signed.reply.tokens is not None
            if any(theirs.get(position) != token for position, token in pairs):
                return s.signed
        return None

    async def _settle(self, tape: HopTape, step, others: list[Hop], sampling: SamplingParams) -> Optional[str]:
        """Replay the differing ``step`` aligned on the witness and a third replica; blame the odd one."""
        w = await self._replay(tape, step, others[0], sampling)
        t = await self._replay(tape, step, others[1], sampling) if len(others) > 1 else None
        mine = (_token_answer(step.reply), _rows(step.reply.tensor, step.output) if step.output else None)
        tol = TOLERANCE.get(_dtype(step), 0.0)
        aw, d = _agree(mine, w.answer, tol)
        at = wt = None
        if t is not None:
            at, _ = _agree(mine, t.answer, tol)
            wt, _ = _agree(w.answer, t.answer, tol)
        who = culprit(aw, at, wt)
        if who is None:
            self.stats.inconclusive += 1
            why = ("the aligned replay agrees with it" if aw else "no third replica" if t is None
                   else "three different answers")
            log.warning("a difference at %s is not blamed on anyone: %s", tape.hop, why)
            return None
        self.stats.mismatches += 1
        signed = {"accused": SignedClaim(self._claim(tape, step, sampling), step.reply.signature,
                                         self.reply_key(tape.hop.peer_id))}
        for name, a in (("witness", w), ("third", t)):
            signed[name] = SignedClaim(a.claim, a.signature, self.reply_key(a.hop.peer_id))
        guilty = signed.pop(who)
        peer = guilty.claim.peer_id
        self._exclude(peer, f"outvoted on layers [{tape.hop.start}, {tape.hop.end}) at position {step.inputs.position}")
        outputs = {"accused": bytes(step.output), "witness": w.output, "third": t.output}
        small = all(len(o) <= MAX_OUTPUT_BYTES for o in outputs.values()) and bool(step.output)
        history, _ = join(tape.inputs_before(step.inputs.position + step.inputs.count))
        case = Mismatch(accused=guilty, witnesses=list(signed.values()), distance=min(d, 1e11), tolerance=tol,
                        inputs=bytes(step.inputs.data) if len(step.inputs.data) <= MAX_INPUT_BYTES else b"",
                        outputs=[outputs[who]] + [outputs[n] for n in signed] if small else [],
                        history=history if len(history) <= MAX_HISTORY_BYTES else b"")
        if all(c.reply_key and c.valid() for c in [guilty, *signed.values()]):
            self.cases[peer] = case
            if self.publish is not None:
                await self.publish(list(self.cases.values()))
        return peer

    async def _replay(self, tape: HopTape, step, replica: Hop, sampling: SamplingParams) -> Answer:
        """``replica`` runs the history before ``step`` as a prefill, then ``step`` alone (asking,
        for a speculative step, the token after each of as many positions)."""
        p = step.inputs.position
        payload, rows = join(tape.inputs_before(p))
        outputs = len(step.reply.tokens) if step.reply.tokens is not None else 1
        calls = ([(0, rows, step.inputs.dtype, payload, 1)] if rows else []) + [
            (p, step.inputs.count, step.inputs.dtype, step.inputs.data, outputs)]
        if tape.extras:  # the last hop's token history and the step's grammar mask go along
            masks = [None] * (len(calls) - 1) + [step.allowed]
            calls = [(*c, tape.history(c[0] + c[1])[c[0]:], mask) for c, mask in zip(calls, masks)]
        replies, sid = await self._run(replica, calls, p + step.inputs.count, sampling)
        (reply, out), meta = replies[-1], replies[-1][0].tensor
        claim = make_claim(model=self.model_id, peer_id=replica.peer_id, session_id=sid, start=tape.hop.start,
                           end=tape.hop.end, position=p, count=step.inputs.count,
                           commitment=tape.commitment_of(step), output=reply_output_digest(reply, out),
                           kind=_kind(reply), dtype=self.dtype, sampling=sampling,
                           extras=_extras(tape, step, sampling), returned=_returned(reply))
        hidden = _rows(meta, out) if meta is not None else None
        return Answer(replica, claim, reply.signature, _token_answer(reply), hidden,
                      bytes(out) if meta is not None else b"")

    async def _run(self, replica: Hop, calls, max_length: int, sampling: SamplingParams):
        """Send ``calls`` (``(position, rows, dtype, payload, outputs)``, the first at position 0)
        to a check session over ``replica``'s span, kept open between checks
        (``client/trust/witness_pool.py``); each call's (reply, bytes), and the session id."""
        return await self.witnesses.run(replica, calls, max_length, sampling)

    def _exclude(self, peer: str, why: str) -> None:
        if peer not in self.excluded:
            log.warning("verification: no longer routing to %s: %s", peer, why)
        self.excluded[peer] = why


def token_windows(first: int, end: int, rows: int, dtype: str, payload: bytes) -> list[tuple]:
    """Calls ``(position, rows, dtype, payload, outputs)`` that replay ``rows`` input rows ending at
    ``end`` (``payload``, from position 0) and ask for the token after each position in
    [``first``, ``end``): the first call also carries the rows before ``first``, and no call asks
    for more than ``MAX_VERIFY_OUTPUTS`` tokens."""
    size = len(payload) // max(rows, 1)
    cuts = [0] + list(range(min(first + MAX_VERIFY_OUTPUTS, end), end, MAX_VERIFY_OUTPUTS)) + [end]
    calls = []
    for a, b in zip(cuts, cuts[1:]):
        calls.append((a, b - a, dtype, payload[a * size:b * size], b - max(a, first)))
    return calls


def _agree(a: tuple, b: tuple, tol: float) -> tuple[bool, float]:
    """Whether two (token, hidden) answers agree: hidden states within ``tol``, else tokens exactly;
    and their distance."""
    if a[1] is not None and b[1] is not None:
        d = distance(a[1], b[1])
        return d <= tol, d
    return a[0] == b[0] and a[1] is None and b[1] is None, 0.0


def _token_answer(reply) -> Optional[int | tuple]:
    """A reply's token, or its tokens as a tuple (a speculative step)."""
    return tuple(reply.tokens) if reply.tokens is not None else reply.token


def _extras(tape: HopTape, step, sampling: SamplingParams) -> bytes:
    """``ReplyClaim.extras`` of ``step`` (as signed) of ``tape``: the sampling's, the token history
    the hop was sent through the step, and the step's mask."""
    end = step.inputs.position + step.inputs.count
    return extras_digest(sampling, tape.history(end) if tape.extras else None, step.allowed)


def _returned(reply) -> bytes:
    """``ReplyClaim.returned`` of a reply: the log-probabilities it carried."""
    return returned_digest(getattr(reply, "logprobs", None), getattr(reply, "prompt_logprobs", None))


def _kind(reply) -> str:
    """What a ForwardResult returned, as its claim names it."""
    return "hidden" if reply.tensor is not None else "tokens" if reply.tokens is not None else "token"


def _dtype(step) -> str:
    tensor = getattr(step.reply, "tensor", None)
    return tensor.dtype if tensor is not None else "token"


def _rows(meta, payload) -> torch.Tensor:
    return tensor_from_wire(meta, bytes(payload)).reshape(meta.shape[0], -1)
