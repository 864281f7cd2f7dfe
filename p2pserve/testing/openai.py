"""A fake client for the OpenAI server's tests: finished replies and streams without a swarm."""

from __future__ import annotations

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
    """A ``ReplyStream`` stand-in: yields "Hello", " world", then ``error`` if given, else ends."""

    def __init__(self, error: BaseException | None = None, open_error: BaseException | None = None):
        self.pieces = ["Hello", " world"]
        self.error, self.open_error, self.reply = error, open_error, None
        self.closed = False

    async def open(self) -> None:
        """Fails with ``open_error`` if given."""
        if self.open_error:
            raise self.open_error

    def __aiter__(self) -> "FakeReplyStream":
        return self

    async def __anext__(self) -> str:
        if self.pieces:
            return self.pieces.pop(0)
        if self.error:
            raise self.error
        self.reply = fake_reply()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Record the early stop."""
        self.closed = True


class FakeClient:
    """An ``AsyncClient`` stand-in for the OpenAI server: answers "Hello world", or raises ``error``
    (before any text) or ``stream_error`` (after the text, streamed requests only)."""

    model_id = FAKE_MODEL_ID

    def __init__(self, error: BaseException | None = None, stream_error: BaseException | None = None):
        self.error, self.stream_error = error, stream_error
        self.requests: list[tuple[str, object]] = []  # (kind, GenerationParams) of every request

    async def chat(self, messages, params=None, **kw):
        """A finished reply, or ``error``."""
        self.requests.append(("chat", params))
        if self.error:
            raise self.error
        return fake_reply()

    async def generate(self, prompt, params=None, **kw):
        """A finished reply, or ``error``."""
        self.requests.append(("completion", params))
        if self.error:
            raise self.error
        return fake_reply()

    def chat_stream(self, messages, params=None, **kw) -> FakeReplyStream:
        """A stream whose ``open()`` raises ``error``."""
        self.requests.append(("chat", params))
        return FakeReplyStream(error=self.stream_error, open_error=self.error)

    def generate_stream(self, prompt, params=None, **kw) -> FakeReplyStream:
        """A stream whose ``open()`` raises ``error``."""
        self.requests.append(("completion", params))
        return FakeReplyStream(error=self.stream_error, open_error=self.error)
