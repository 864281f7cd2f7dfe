"""A fake client for the OpenAI server's tests: finished replies and streams without a swarm.

The server uses an ``AsyncClient`` through four calls: ``model_id``, ``chat_prompt`` /
``text_prompt`` (tokenising, off the event loop) and ``generate_stream`` on the token ids. The
fake records each of them, and its streams record how they ended, so that tests can tell that a
prompt was never tokenised or that a disconnect cancelled the generation.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Optional

from p2pserve.testing.peers import FAKE_MODEL_ID


def fake_reply(text: str = "Hello world"):
    """A finished ``Reply`` as the OpenAI server reads it (route through one fake peer)."""
    from p2pserve.client.hop import Hop
    from p2pserve.client.reply import Reply

    reply = Reply(text)
    reply.tokens, reply.finish_reason, reply.prompt_tokens = [1, 2], "stop", 3
    reply.route, reply.routes, reply.failures = [Hop("peerA", 0, 8)], [[Hop("peerA", 0, 8)]], []
    reply.elapsed_s, reply.first_token_s = 0.2, 0.01
    return reply


class FakeReplyStream:
    """A ``ReplyStream`` stand-in: yields "Hello", " world", then raises ``error`` if given, else ends.

    With ``hold`` it yields "Hello" and then waits until cancelled, like a generation whose next
    token never comes; ``cancelled`` and ``closed`` tell how it ended.
    """

    def __init__(self, error: BaseException | None = None, open_error: BaseException | None = None,
                 hold: bool = False):
        self.pieces = ["Hello", " world"]
        self.error, self.open_error, self.hold, self.reply = error, open_error, hold, None
        self.opened = self.closed = self.cancelled = False

    async def open(self) -> None:
        """Fails with ``open_error`` if given."""
        self.opened = True
        if self.open_error:
            raise self.open_error

    def __aiter__(self) -> "FakeReplyStream":
        return self

    async def __anext__(self) -> str:
        if self.hold and len(self.pieces) == 1:
            try:
                await asyncio.Event().wait()  # never set: only a cancellation ends it
            except asyncio.CancelledError:
                self.cancelled = True
                raise
        if self.pieces:
            return self.pieces.pop(0)
        if self.error:
            raise self.error
        self.reply = fake_reply()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Record the close (the real stream closes its swarm sessions here)."""
        self.closed = True


class FakeClient:
    """An ``AsyncClient`` stand-in for the OpenAI server: answers "Hello world", or raises ``error``
    when the stream opens (before any text) or ``stream_error`` after the text. ``hold`` makes
    every stream wait after its first piece until cancelled; ``tokenize_gate`` makes tokenising
    block its thread until the event is set (``tokenizing`` is set meanwhile)."""

    model_id = FAKE_MODEL_ID

    def __init__(self, error: BaseException | None = None, stream_error: BaseException | None = None,
                 hold: bool = False, tokenize_gate: Optional[threading.Event] = None):
        self.error, self.stream_error, self.hold = error, stream_error, hold
        self.tokenize_gate, self.tokenizing = tokenize_gate, threading.Event()
        self.tokenized: list[object] = []  # every prompt given to chat_prompt / text_prompt
        self.requests: list[tuple[list[int], object]] = []  # (prompt ids, GenerationParams) per generation
        self.streams: list[FakeReplyStream] = []

    def chat_prompt(self, messages) -> list[int]:
        """Three token ids for any conversation (recorded)."""
        self._tokenize(messages)
        return [1, 2, 3]

    def text_prompt(self, prompt) -> list[int]:
        """Token ids given as such are kept; a string becomes three ids (recorded)."""
        self._tokenize(prompt)
        return list(prompt) if isinstance(prompt, list) else [1, 2, 3]

    def _tokenize(self, prompt) -> None:
        self.tokenized.append(prompt)
        if self.tokenize_gate is not None:
            self.tokenizing.set()
            self.tokenize_gate.wait()  # blocks this thread, as a long prompt's tokenising does

    def generate_stream(self, prompt, params=None, **kw) -> FakeReplyStream:
        """A new :class:`FakeReplyStream` (kept in ``streams``) after the token ids ``prompt``."""
        self.requests.append((list(prompt), params))
        stream = FakeReplyStream(error=self.stream_error, open_error=self.error, hold=self.hold)
        self.streams.append(stream)
        return stream
