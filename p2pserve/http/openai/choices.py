"""A request's choices: prepared off the loop, started, and streamed as one event stream.

:func:`prepare_request` runs on the API's tokenising thread: it renders the prompt (with the
request's tools through the chat template) and compiles the grammar a ``response_format`` or a
forced ``tool_choice`` needs. :func:`start_choices` starts one generation per choice: the first
at once, the others once the first one's prompt has run, each forking the first one's sessions
(``Pipeline.fork_from``): they hold its KV of the prompt, shared copy-on-write, and compute only
the prompt's last position. :class:`ChoiceEvents` merges the choices' events into server-sent events.
"""

from __future__ import annotations

import asyncio
import json
from typing import Callable, Optional

from p2pserve.client.choices import choice_params
from p2pserve.client.grammar import compiler_for
from p2pserve.http.openai.extras import Rendering, TokenNames, chat_logprobs, completion_logprobs
from p2pserve.http.openai.schema import GenRequest, chunk_body, http_error_for, route_info, usage
from p2pserve.client.tools import ToolStream

def prepare_request(client, g: GenRequest) -> tuple[list[int], object]:
    """(prompt token ids, GenerationParams with the grammar compiled in) of request ``g``;
    blocking: run it on the tokenising thread."""
    ex = g.extras
    if g.kind == "chat":
        tools = ex.tools.template_tools if ex.tools is not None else None
        ids = client.chat_prompt(g.messages, tools=tools) if tools else client.chat_prompt(g.messages)
    else:
        ids = client.text_prompt(g.prompt)
    schema = ex.tools.schema() if ex.tools is not None else None
    if schema is None and ex.response_format is None:
        return ids, g.params
    info = client.info
    compiler = compiler_for(info.tokenizer, info.spec.vocab_size, info.eos_ids)
    grammar = compiler.json_schema(schema) if schema is not None else compiler.response_format(ex.response_format)
    return ids, g.params.with_sampling(grammar=grammar)


def start_choices(client, ids: list[int], params, n: int, make_job: Callable) -> list:
    """``n`` jobs (``make_job(stream, after)``) generating after ``ids``; choice i > 0 waits for
    choice 0's ``started``, forks its sessions and, when sampling, draws with seed ``params.seed + i``."""
    jobs: list = []
    for p in choice_params(params, n):
        stream = client.generate_stream(ids, params=p, fork_of=jobs[0].stream if jobs else None)
        jobs.append(make_job(stream, jobs[0].started if jobs else None))
    return jobs


def _event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class ChoiceEvents:
    """The events of a request's choice jobs: :meth:`opened` waits until every route is open,
    :meth:`sse` yields the server-sent events of all choices, each chunk naming its ``index``."""

    def __init__(self, jobs: list):
        self.jobs = jobs
        self._merged: asyncio.Queue = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []

    async def opened(self) -> Optional[tuple]:
        """None once every choice's route is open, else the first job's failure event."""
        for job in self.jobs:
            what, value = await job.events.get()
            if what != "open":
                return what, value
        return None

    async def _pump(self, index: int, job) -> None:
        while True:
            event = await job.events.get()
            self._merged.put_nowait((index, event))
            if event[0] in ("end", "error", "cancelled"):
                return

    async def sse(self, g: GenRequest, rid: str, created: int, rendering: Rendering):
        """The stream's events, ending with ``data: [DONE]`` (none when the client went away)."""
        self._pumps = [asyncio.create_task(self._pump(i, job)) for i, job in enumerate(self.jobs)]
        try:
            async for chunk in self._chunks(g, rid, created, rendering):
                yield chunk
        finally:
            for task in self._pumps:
                task.cancel()

    async def _chunks(self, g: GenRequest, rid: str, created: int, rendering: Rendering):
        ex, n = g.extras, len(self.jobs)
        tools = ex.tools if ex.tools is not None and ex.tools.parses else None
        splitters = [ToolStream(tools, rendering.tool_format) if tools else None for _ in range(n)]
        for i in range(n):
            if g.kind == "chat":
                yield _event(chunk_body(g, rid, created, text="", role=True, index=i))
            elif ex.echo:
                yield _event(chunk_body(g, rid, created, text=rendering.prompt_text(g), index=i))
        replies: list = [None] * n
        while any(r is None for r in replies):
            i, (what, value) = await self._merged.get()
            if what == "text":
                piece, new = value
                if splitters[i] is not None:
                    piece = splitters[i].feed(piece)
                logprobs = _logprobs(g, rendering, new)
                if piece or logprobs:
                    yield _event(chunk_body(g, rid, created, text=piece, index=i, logprobs=logprobs))
            elif what == "end":
                finish = value.finish_reason
                if splitters[i] is not None:
                    content, calls = splitters[i].finish(rendering.full_text(value))
                    if content:
                        yield _event(chunk_body(g, rid, created, text=content, index=i))
                    if calls:
                        yield _event(chunk_body(g, rid, created, index=i,
                                                tool_calls=[c.openai(k) for k, c in enumerate(calls)]))
                        finish = "tool_calls" if tools.choice != "named" else finish
                final = chunk_body(g, rid, created, text=None if g.kind == "chat" else "", finish_reason=finish,
                                   index=i)
                final["p2pserve"] = route_info(value)
                yield _event(final)
                replies[i] = value
            elif what == "error":  # headers are gone: report in-band, as OpenAI does
                yield _event(http_error_for(value).body())
                break
            else:  # cancelled: the client went away
                return
        if g.include_usage and all(r is not None for r in replies):
            yield _event({"id": rid, "object": "chat.completion.chunk" if g.kind == "chat" else "text_completion",
                          "created": created, "model": g.model, "choices": [], "usage": usage(replies)})
        yield b"data: [DONE]\n\n"


def _logprobs(g: GenRequest, rendering: Rendering, entries: list) -> Optional[dict]:
    """A streamed chunk's log-probabilities (of the tokens since the previous chunk)."""
    if not g.extras.logprobs or not entries:
        return None
    names = TokenNames(rendering.tokenizer, g.extras.token_ids)
    if g.kind == "chat":
        return chat_logprobs(names, entries)
    return completion_logprobs(names, [e.token for e in entries], entries)
