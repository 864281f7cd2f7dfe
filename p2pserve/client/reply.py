"""What a request returns: the :class:`Reply` text with what produced it, or a :class:`ReplyStream`
of text pieces that ends with one."""

from __future__ import annotations

from typing import Optional

from p2pserve.client.generation import Generation
from p2pserve.client.hop import Hop


class Reply(str):
    """The reply text, with what produced it.

    Attributes: ``tokens`` (generated ids), ``finish_reason`` ("stop" or "length"),
    ``prompt_tokens``, ``route`` (the hops of the last route used), ``routes`` (every route, more
    than one after a failover), ``failures`` (failed hops, as text), ``elapsed_s`` and
    ``first_token_s`` (seconds from the request to the first token), ``rolled_back`` (tokens
    withdrawn and regenerated because a peer that computed them was caught, client/trust/rollback.py),
    ``logprobs`` and ``prompt_logprobs`` (``TokenLogprob`` lists, when the request asked for them).
    """

    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    route: list[Hop]
    routes: list[list[Hop]]
    failures: list[str]
    elapsed_s: float
    first_token_s: Optional[float]
    rolled_back: int
    logprobs: list  # a client.logprobs.TokenLogprob per generated token, when asked for
    prompt_logprobs: list  # one per prompt token but the first (``prompt_logprobs=True``)
    tool_calls: list  # client.tools.ToolCall of a chat with tools (``content``: the text without them)
    content: str

    @classmethod
    def of(cls, generation: Generation) -> "Reply":
        """The reply of a finished generation (its pipeline tells the routes and failures)."""
        result, pipeline = generation.result, generation.pipeline
        reply = cls(result.text)
        reply.tokens = list(result.tokens)
        reply.finish_reason = result.finish_reason
        reply.prompt_tokens = result.prompt_tokens
        reply.route = list(pipeline.route)
        reply.routes = [list(r) for r in pipeline.route_log]
        reply.failures = [str(f) for f in pipeline.failures]
        reply.elapsed_s = generation.elapsed_s
        reply.first_token_s = generation.first_token_s
        reply.rolled_back = generation.rolled_back
        reply.logprobs = list(result.logprobs)
        reply.prompt_logprobs = list(result.prompt_logprobs)
        reply.tool_calls, reply.content = [], reply.text
        return reply

    @property
    def text(self) -> str:
        """The reply as a plain ``str``."""
        return str.__str__(self)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second over the whole request."""
        return len(self.tokens) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def route_text(self) -> str:
        """The route as 'peer[a:b) -> peer[b:c)' (last route; earlier ones after ' | ')."""
        return " | ".join(" -> ".join(str(h) for h in r) for r in self.routes) or "(none)"


class ReplyStream:
    """An async iterator of text pieces (incomplete UTF-8 and possible stop-string prefixes held
    back); ``reply`` holds the finished :class:`Reply` once it is exhausted.

    The stream owns its generation's pipeline: it closes it at the end, on error and on
    :meth:`aclose`.
    """

    def __init__(self, generation: Generation):
        self.generation = generation
        generation.withdraw = False  # text sent cannot be unsent: a caught peer only changes the route
        self.pipeline = generation.pipeline
        self.reply: Optional[Reply] = None
        self._closed = False

    async def open(self) -> None:
        """Open the route now, so that "no route" / "overloaded" surface before any text.

        (The HTTP server calls this before it commits to a 200 streaming response.)
        """
        try:
            await self.pipeline.open()
        except BaseException:
            await self.aclose()
            raise

    def __aiter__(self) -> "ReplyStream":
        return self

    async def __anext__(self) -> str:
        if self._closed:
            raise StopAsyncIteration
        try:
            async for event in self.generation:
                if event.text:
                    return event.text
        except BaseException:
            await self.aclose()
            raise
        await self.aclose()
        self.reply = Reply.of(self.generation)
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Stop early (closes the sessions on the peers)."""
        self._closed = True
        await self.pipeline.close()
