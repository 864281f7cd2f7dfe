"""The coordinator re-executes an accused step itself before it excludes anyone.

An accusation (a holding, self-evident case from an untrusted reporter: ``coordinator/exclusion.py``)
is a reason to look, not a verdict. Signatures prove what each peer answered, not who computed
right, and a reporter's identity is free; counting reporters would let a few throwaway keys frame
an honest peer. So the leader runs the accused step again:

* it takes the case's input history (``Mismatch.history``, every input row from position 0,
  whose hash chain must be the accused's signed commitment: the very inputs the accused signed);
* it chooses the replicas itself (:func:`choose_replicas`): serving peers whose range holds the
  span, announcing the claim's dtype, neither the accused nor excluded, the reporter's witnesses
  last, at random otherwise;
* on each it opens an ordinary session over the span with the claim's sampling parameters, through
  the same node of its own as its compute probes (an identity other than the coordinator's), and
  sends the history as one prefill (:func:`replay`);
* it compares the replicas' outputs with what the accused *signed* (:func:`decide`): hidden states
  within the tolerance of the signed dtype, tokens by the signed digest. It convicts only when
  ``replicas`` replicas agree with one another and each disagrees with the accused; it acquits
  when a replica reproduces the accused's output; anything else is inconclusive (no verdict).

One retrial per case (by the accused claim's digest), its outcome remembered; at most
``per_round`` retrials per coordinator round, so a flood of accusations costs the coordinator a
bounded amount of work, and the peers a prefill of at most ``MAX_HISTORY_BYTES`` each.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
from dataclasses import dataclass
from typing import Awaitable, Callable, Collection, Mapping, Optional

from p2pserve.dht.evidence import TOLERANCE, Mismatch, output_digest, row_distance, rows_of
from p2pserve.dht.records import PeerInfo
from p2pserve.errors import MalformedFrameError
from p2pserve.protocol import (
    MAX_VERIFY_OUTPUTS,
    PROTOCOL_VERSION,
    CloseSession,
    Forward,
    ForwardResult,
    FrameLimits,
    OpenSession,
    SamplingParams,
    SessionOpened,
    tokens_bytes,
)
from p2pserve.transport import Transport
from p2pserve.transport.session_stream import SessionStream, open_session_stream
from p2pserve.wire_types import DTYPE_SIZES, TensorMeta

logger = logging.getLogger(__name__)

CONVICT, ACQUIT, INCONCLUSIVE = "convict", "acquit", "inconclusive"


@dataclass(frozen=True)
class Outcome:
    """A retrial's result: ``verdict`` (CONVICT, ACQUIT or INCONCLUSIVE) and what it rests on."""

    verdict: str
    reason: str


def choose_replicas(case: Mismatch, peers: Mapping[str, PeerInfo], excluded: Collection[str],
                    rng: random.Random) -> list[PeerInfo]:
    """Peers that can run the accused span, in the order to ask them: not the accused, not
    excluded, serving a range that holds the span in the claim's dtype; peers the reporter did
    not name first (its witnesses may be its accomplices), each group shuffled."""
    claim = case.accused.claim
    named = {w.claim.peer_id for w in case.witnesses}
    able = [p for pid, p in sorted(peers.items())
            if pid != claim.peer_id and pid not in excluded and p.serving is not None and p.state != "draining"
            and p.serving[0] <= claim.start and claim.end <= p.serving[1] and p.dtype == claim.dtype]
    fresh, witnesses = [p for p in able if p.peer_id not in named], [p for p in able if p.peer_id in named]
    rng.shuffle(fresh)
    rng.shuffle(witnesses)
    return fresh + witnesses


def accused_matches(case: Mismatch, answer: bytes | list[int]) -> Optional[bool]:
    """Whether a replica's ``answer`` reproduces what the accused signed: hidden rows (the step's
    rows, bytes) within the dtype's tolerance of the accused's output, or tokens (the token after
    each of the step's last positions) whose digest, for some suffix, is the accused's. None when
    the case lacks the accused's hidden output to compare with."""
    claim = case.accused.claim
    if claim.kind == "hidden":
        if not case.outputs or output_digest(case.outputs[0]) != claim.output or not isinstance(answer, bytes):
            return None
        mine, theirs = rows_of(claim.dtype, case.outputs[0], claim.count), rows_of(claim.dtype, answer, claim.count)
        return row_distance(mine, theirs) <= TOLERANCE[claim.dtype]
    if not isinstance(answer, list):  # a replica answered a token case with hidden rows: nothing to compare
        return None
    if claim.kind == "token":
        return output_digest(token=answer[-1]) == claim.output
    return any(output_digest(tokens_bytes(answer[-m:])) == claim.output for m in range(1, len(answer) + 1))


def replicas_agree(kind: str, dtype: str, count: int, a: bytes | list[int], b: bytes | list[int]) -> bool:
    """Whether two replicas' answers to the same step agree (hidden within tolerance, tokens equal)."""
    if kind == "hidden":
        if not (isinstance(a, bytes) and isinstance(b, bytes)):
            return False
        return row_distance(rows_of(dtype, a, count), rows_of(dtype, b, count)) <= TOLERANCE[dtype]
    return list(a) == list(b)


def decide(case: Mismatch, answers: Mapping[str, bytes | list[int]], needed: int) -> Outcome:
    """The verdict from the replicas' ``answers`` (peer id -> answer): see the module docstring."""
    claim = case.accused.claim
    matches = {pid: accused_matches(case, a) for pid, a in answers.items()}
    if any(m is None for m in matches.values()):
        return Outcome(INCONCLUSIVE, "the case does not carry the accused's output")
    if any(matches.values()):
        who = sorted(pid for pid, m in matches.items() if m)
        return Outcome(ACQUIT, f"replica {who[0]} reproduced the accused's signed output")
    if len(answers) < needed:
        return Outcome(INCONCLUSIVE, f"{len(answers)} replica(s) answered, {needed} needed")
    values = list(answers.values())
    if not all(replicas_agree(claim.kind, claim.dtype, claim.count, values[0], v) for v in values[1:]):
        return Outcome(INCONCLUSIVE, "the replicas disagree with one another")
    return Outcome(CONVICT, f"re-executed by the coordinator on {', '.join(sorted(answers))}: they agree, the "
                            f"accused's signed {claim.kind} output differs")


async def replay(transport: Transport, info: PeerInfo, case: Mismatch, timeout_s: float,
                 limits: FrameLimits = FrameLimits()) -> bytes | list[int]:
    """Run the case's history on ``info`` over the accused span, as one prefill with the claim's
    sampling; the step's hidden rows (bytes), or the tokens after its last positions."""
    claim = case.accused.claim
    rows = claim.position + claim.count
    sampling = SamplingParams(claim.temperature, claim.top_k, claim.top_p, claim.seed)
    stream = await open_session_stream(transport, info.peer_id, info.addrs, timeout_s)
    link = SessionStream(info.peer_id, limits, timeout_s, stream)
    sid = secrets.token_hex(16)
    try:
        opened, _ = await link.call(OpenSession(version=PROTOCOL_VERSION, model_id=claim.model, session_id=sid,
                                             start=claim.start, end=claim.end, max_length=rows, sampling=sampling))
        if not isinstance(opened, SessionOpened):
            raise MalformedFrameError(f"expected SessionOpened, got {type(opened).__name__}")
        width = len(case.history) // rows
        dtype = "int64" if claim.start == 0 else claim.dtype
        shape = [rows] if claim.start == 0 else [rows, width // DTYPE_SIZES[dtype]]
        outputs = 1 if claim.kind != "tokens" else min(claim.count, MAX_VERIFY_OUTPUTS)
        meta = TensorMeta(dtype=dtype, shape=shape, nbytes=len(case.history))
        reply, body = await link.call(Forward(session_id=sid, step=0, position=0, tensor=meta,
                                        outputs=outputs if claim.kind != "hidden" else 1), case.history)
        if not isinstance(reply, ForwardResult):
            raise MalformedFrameError(f"expected ForwardResult, got {type(reply).__name__}")
        try:
            await link.call(CloseSession(session_id=sid))
        except Exception:  # closing is best effort
            pass
    finally:
        stream.close()
    if claim.kind == "hidden":
        if reply.tensor is None:
            raise MalformedFrameError("expected hidden states")
        step = len(body) // rows * claim.count
        return bytes(body[len(body) - step:])
    if reply.tokens is not None:
        return list(reply.tokens)
    if reply.token is None:
        raise MalformedFrameError("expected a token")
    return [reply.token]


class Retrials:
    """The leader's retrials: each case once, outcomes remembered, ``per_round`` per round.

    ``node()`` returns the transport to open sessions through (the compute prober's own node).
    """

    def __init__(self, node: Callable[[], Awaitable[Transport]], replicas: int = 2, per_round: int = 4,
                 timeout_s: float = 20.0, seed: Optional[int] = None, memory: int = 4096):
        self.node, self.replicas, self.per_round, self.timeout_s = node, replicas, per_round, timeout_s
        self.rng = random.Random(seed)
        self.memory = memory
        self.outcomes: dict[bytes, Outcome] = {}  # accused claim digest -> outcome

    async def convictions(self, accused: Mapping[str, list[tuple[str, Mismatch]]], peers: Mapping[str, PeerInfo],
                          excluded: Collection[str]) -> dict[str, str]:
        """Peers this coordinator's own re-execution convicts, with the reason; runs at most
        ``per_round`` new retrials (cases already tried keep their outcome)."""
        out: dict[str, str] = {}
        budget = self.per_round
        for peer, cases in sorted(accused.items()):
            for reporter, case in cases:
                key = case.accused.claim.digest()
                outcome = self.outcomes.get(key)
                if outcome is None:
                    if budget <= 0 or not case.history_matches():
                        continue
                    budget -= 1
                    outcome = await self.retry(case, peers, excluded)
                    if outcome.verdict != INCONCLUSIVE:  # an inconclusive one may be tried again
                        self._remember(key, outcome)
                    logger.info(f"retrial of {peer} (accused by {reporter}): {outcome.verdict}: {outcome.reason}")
                if outcome.verdict == CONVICT:
                    out[peer] = outcome.reason
                    break
        return out

    async def retry(self, case: Mismatch, peers: Mapping[str, PeerInfo], excluded: Collection[str]) -> Outcome:
        """Re-execute one case on replicas this coordinator chooses."""
        if case.accused.claim.extras:  # bound by digest only: the case cannot say what to re-execute with
            return Outcome(INCONCLUSIVE, "the claim's token used sampling extras, a history or a mask "
                                         "(ReplyClaim.extras) that a retrial cannot reproduce")
        answers: dict[str, bytes | list[int]] = {}
        for info in choose_replicas(case, peers, excluded, self.rng):
            if len(answers) >= self.replicas:
                break
            try:
                answers[info.peer_id] = await replay(await self.node(), info, case, self.timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a replica that fails is no evidence either way
                logger.info(f"retrial replay on {info.peer_id} failed: {type(e).__name__}: {e}")
        try:
            return decide(case, answers, self.replicas)
        except ValueError as e:  # an answer of the wrong size
            return Outcome(INCONCLUSIVE, str(e))

    def _remember(self, key: bytes, outcome: Outcome) -> None:
        if len(self.outcomes) >= self.memory:
            self.outcomes.pop(next(iter(self.outcomes)))
        self.outcomes[key] = outcome
