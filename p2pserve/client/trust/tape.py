"""What a pipeline keeps of each hop for re-execution: the inputs it relayed and the replies.

A :class:`HopTape` holds, for one hop's session, every input chunk the client sent (token ids or
hidden-state bytes, position, row count) and each step's signed reply with its output bytes. The
bytes are the very objects the pipeline relayed (no copy): a hop's outputs are the next hop's
inputs. A rewind (a step starting before the tape's end) drops what follows it, as the peer
drops it from its cache and its input commitment; a step it cuts in two keeps its head, and the
whole step as sent and signed (``Step.whole``). That is how a speculative step ends (the rows of
rejected drafts are rewound): the head's rows and their outputs are the ones the client kept,
and evidence about them needs the signed original.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from p2pserve.client.hop import Hop
from p2pserve.dht.evidence import InputChain, output_digest, row_digests
from p2pserve.protocol import tokens_bytes
from p2pserve.types import SessionId


@dataclass
class Chunk:
    """``count`` rows at ``position``: their raw bytes (``dtype``, ``count`` equal rows), and for
    a last hop the token ids at those positions it was sent (``Forward.context``), if any."""

    position: int
    count: int
    dtype: str
    data: bytes | memoryview
    context: Optional[list] = None

    def head(self, rows: int) -> "Chunk":
        """The first ``rows`` rows of this chunk."""
        size = len(self.data) // self.count
        context = self.context[:rows] if self.context is not None else None
        return Chunk(self.position, rows, self.dtype, memoryview(self.data)[: rows * size], context)


@dataclass
class Step:
    """One step of a hop: its inputs' chunk, the peer's reply and output bytes. The head of a
    step cut by a rewind has no reply and the whole step in ``whole``."""

    inputs: Chunk
    reply: object  # the ForwardResult
    output: bytes | memoryview
    whole: Optional["Step"] = None
    allowed: Optional[bytes] = None  # the grammar's mask the last hop was sent (``Forward.allowed``)

    @property
    def signed(self) -> Optional["Step"]:
        """The step as the peer signed it: this one, the whole one a head was cut from, or None."""
        return self if self.reply is not None else self.whole

    def tokens_kept(self) -> list[tuple[int, int]]:
        """(position, token): the tokens the last hop returned after positions still on the tape
        (a one-token step's token after its last row; a speculative step's tokens after each of
        its last ``len(tokens)`` rows, as far as the head reaches)."""
        signed = self.signed
        if signed is None:
            return []
        end = self.inputs.position + self.inputs.count
        tokens = signed.reply.tokens
        if tokens is None:
            return [(end - 1, signed.reply.token)] if signed is self and signed.reply.token is not None else []
        first = signed.inputs.position + signed.inputs.count - len(tokens)
        return [(first + i, t) for i, t in enumerate(tokens) if first + i < end]

    def output_kept(self) -> bytes | memoryview:
        """The hidden-state bytes of this step's rows still on the tape (a head's share of the
        whole step's output)."""
        signed = self.signed
        if signed is None or signed is self:
            return self.output if signed is not None else b""
        size = len(signed.output) // signed.inputs.count
        return memoryview(signed.output)[: self.inputs.count * size]


@dataclass
class HopTape:
    """Everything one hop's session consumed and returned (see the module docstring)."""

    hop: Hop
    session_id: SessionId
    steps: list[Step] = field(default_factory=list)
    due: Optional[object] = None  # the SamplingParams of a check drawn for when the route is done

    def record(self, position: int, count: int, dtype: str, data, reply, output, context=None, allowed=None) -> None:
        """Append a step at ``position``; a rewind first drops the steps at and after it."""
        self.truncate(position)
        self.steps.append(Step(Chunk(position, count, dtype, data, context), reply, output, allowed=allowed))

    @property
    def extras(self) -> bool:
        """Whether the hop was sent token history (a last hop under penalties, a grammar...)."""
        return any(s.inputs.context is not None for s in self.steps)

    def history(self, position: int) -> Optional[list]:
        """The token ids the hop was sent for positions [0, ``position``), or None if not all."""
        chunks = self.inputs_before(position)
        if any(c.context is None for c in chunks):
            return None
        return [t for c in chunks for t in c.context][:position]

    def seed(self, chunks: list[Chunk], position: int) -> None:
        """Start with another session's inputs ``chunks`` up to ``position`` as this session's
        past (a fork): steps with no reply, which no check compares."""
        for c in chunks:
            if c.position < position:
                chunk = c.head(min(c.count, position - c.position))
                self.steps.append(Step(chunk, None, b""))

    def truncate(self, position: int) -> None:
        """Forget inputs at ``position`` and after (a step cut in two keeps its head, no reply)."""
        while self.steps and self.steps[-1].inputs.position >= position:
            self.steps.pop()
        if self.steps and self.steps[-1].inputs.position + self.steps[-1].inputs.count > position:
            last = self.steps.pop()
            self.steps.append(Step(last.inputs.head(position - last.inputs.position), None, b"", last.signed))

    def inputs_before(self, position: int) -> list[Chunk]:
        """The input chunks covering positions [0, position)."""
        return [s.inputs for s in self.steps if s.inputs.position < position]

    def commitment(self, position: int) -> bytes:
        """``c[position]`` over the inputs recorded, as the peer computes it."""
        return _commitment(self.inputs_before(position), position)

    def commitment_of(self, step: Step) -> bytes:
        """The commitment ``step``'s reply signed: the inputs before its position, then its own
        rows (a whole speculative step's rows are no longer all on the tape)."""
        chunks = self.inputs_before(step.inputs.position) + [step.inputs]
        return _commitment(chunks, step.inputs.position + step.inputs.count)

    @property
    def last(self) -> Optional[Step]:
        """The latest step with a reply."""
        return self.steps[-1] if self.steps and self.steps[-1].reply is not None else None


def _commitment(chunks: list[Chunk], position: int) -> bytes:
    """``c[position]`` of the input chain over ``chunks`` (rows from position 0 on)."""
    chain = InputChain()
    for chunk in chunks:
        chain.extend(row_digests(chunk.data, chunk.count))
    return chain.at(position)


def reply_output_digest(reply, output: bytes | memoryview) -> bytes:
    """The digest a ForwardResult signed over: its token, its tokens (a speculative step), or its
    hidden-state bytes ``output``."""
    tokens = getattr(reply, "tokens", None)
    if tokens is not None:
        return output_digest(tokens_bytes(tokens))
    return output_digest(output, getattr(reply, "token", None))


def join(chunks: list[Chunk]) -> tuple[bytes, int]:
    """The rows of ``chunks`` as one payload, and how many rows it holds."""
    return b"".join(bytes(c.data) for c in chunks), sum(c.count for c in chunks)
