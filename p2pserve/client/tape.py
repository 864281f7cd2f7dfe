"""What a pipeline keeps of each hop for re-execution: the inputs it relayed and the replies.

A :class:`HopTape` holds, for one hop's session, every input chunk the client sent (token ids or
hidden-state bytes, position, row count) and each step's signed reply with its output bytes. The
bytes are the very objects the pipeline relayed (no copy): a hop's outputs are the next hop's
inputs. A rewind (a step starting before the tape's end) drops what follows it, as the peer
drops it from its cache and its input commitment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from p2pserve.client.hop import Hop
from p2pserve.dht.evidence import InputChain, output_digest, row_digests
from p2pserve.protocol import tokens_bytes


@dataclass
class Chunk:
    """``count`` rows at ``position``: their raw bytes (``dtype``, ``count`` equal rows)."""

    position: int
    count: int
    dtype: str
    data: bytes | memoryview

    def head(self, rows: int) -> "Chunk":
        """The first ``rows`` rows of this chunk."""
        size = len(self.data) // self.count
        return Chunk(self.position, rows, self.dtype, memoryview(self.data)[: rows * size])


@dataclass
class Step:
    """One step of a hop: its inputs' chunk, the peer's reply and output bytes."""

    inputs: Chunk
    reply: object  # the ForwardResult
    output: bytes | memoryview


@dataclass
class HopTape:
    """Everything one hop's session consumed and returned (see the module docstring)."""

    hop: Hop
    session_id: str
    steps: list[Step] = field(default_factory=list)
    due: Optional[object] = None  # the SamplingParams of a check drawn for when the route is done

    def record(self, position: int, count: int, dtype: str, data, reply, output) -> None:
        """Append a step at ``position``; a rewind first drops the steps at and after it."""
        self.truncate(position)
        self.steps.append(Step(Chunk(position, count, dtype, data), reply, output))

    def truncate(self, position: int) -> None:
        """Forget inputs at ``position`` and after (a step cut in two keeps its head, no reply)."""
        while self.steps and self.steps[-1].inputs.position >= position:
            self.steps.pop()
        if self.steps and self.steps[-1].inputs.position + self.steps[-1].inputs.count > position:
            last = self.steps.pop()
            self.steps.append(Step(last.inputs.head(position - last.inputs.position), None, b""))

    def inputs_before(self, position: int) -> list[Chunk]:
        """The input chunks covering positions [0, position)."""
        return [s.inputs for s in self.steps if s.inputs.position < position]

    def commitment(self, position: int) -> bytes:
        """``c[position]`` over the inputs recorded, as the peer computes it."""
        chain = InputChain()
        for chunk in self.inputs_before(position):
            chain.extend(row_digests(chunk.data, chunk.count))
        return chain.at(position)

    @property
    def last(self) -> Optional[Step]:
        """The latest step with a reply."""
        return self.steps[-1] if self.steps and self.steps[-1].reply is not None else None


def reply_output_digest(step: Step) -> bytes:
    """The digest a step's reply signed over: its token, its tokens (a speculative step), or its
    hidden-state bytes."""
    tokens = getattr(step.reply, "tokens", None)
    if tokens is not None:
        return output_digest(tokens_bytes(tokens))
    return output_digest(step.output, getattr(step.reply, "token", None))


def join(chunks: list[Chunk]) -> tuple[bytes, int]:
    """The rows of ``chunks`` as one payload, and how many rows it holds."""
    return b"".join(bytes(c.data) for c in chunks), sum(c.count for c in chunks)
