"""A request's choices: prepared off the loop, started, and streamed as one event stream.

:func:`prepare_request` runs on the API's tokenising thread: it renders the prompt (with the
request's tools through the chat template) and compiles the grammar a ``response_format`` or a
forced ``tool_choice`` needs. :func:`start_choices` starts one generation per choice: the first
at once, the others once the first one's prompt has run, each forking the first one's sessions
(``Pipeline.fork_from``): they hold its KV of the prompt, shared copy-on-write, and compute only
the prompt's last position. :class:`ChoiceEvents` merges the choices' events into server-sent events.
"""

from __future__ import annotations

from typing import Callable, Optional

from p2pserve.client.choices import choice_params
from p2pserve.client.grammar import compiler_for
from p2pserve.http.openai.extras import Rendering, TokenNames, chat_logprobs, completion_logprobs
from p2pserve.http.openai.jobs import EventBox
from p2pserve.http.openai.schema import GenRequest, chunk_body, http_error_for, route_info, usage
from p2pserve.http.openai.sse import DONE, ChunkEncoder, event
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
    """``n`` jobs (``make_job(stream, index, after)``) generating after ``ids``; choice i > 0 waits
    for choice 0's ``started``, forks its sessions and, when sampling, draws with seed
    ``params.seed + i``."""
    jobs: list = []
    for i, p in enumerate(choice_params(params, n)):
        stream = client.generate_stream(ids, params=p, fork_of=jobs[0].stream if jobs else None)
        jobs.append(make_job(stream, i, jobs[0].started if jobs else None))
    return jobs


class ChoiceEvents:
    """The events of a request's choice jobs, all reporting to ``box``: :meth:`opened` waits until
    every route is open, :meth:`sse` yields the server-sent events of all choices, each chunk
    naming its ``index``: one bytes object per batch the jobs put together, one chunk per choice
    in it (the text of its tokens joined)."""

    def __init__(self, jobs: list, box: EventBox):
        self.jobs = jobs
        self.box = box

    async def opened(self) -> Optional[tuple]:
        """None once every choice's route is open, else the first job's failure event."""
        for job in self.jobs:
            failure = await job.opened
            if failure is not None:
                return failure
        return None

    async def sse(self, g: GenRequest, rid: str, created: int, rendering: Rendering):
        """The stream's events, ending with ``data: [DONE]`` (none when the client went away)."""
        ex, n = g.extras, len(self.jobs)
        writer = _ChoiceWriter(g, ChunkEncoder(g, rid, created), rendering, n)
        first = []
        for i in range(n):
            if g.kind == "chat":
                first.append(event(chunk_body(g, rid, created, text="", role=True, index=i)))
            elif ex.echo:
                first.append(event(chunk_body(g, rid, created, text=rendering.prompt_text(g), index=i)))
        if first:
            yield b"".join(first)
        while not writer.finished:
            out = writer.batch(await self.box.take())
            if out:
                yield out
            if writer.gone:  # cancelled: the client went away
                return
        replies = writer.replies
        if g.include_usage and all(r is not None for r in replies):
            yield event({"id": rid, "object": "chat.completion.chunk" if g.kind == "chat" else "text_completion",
                         "created": created, "model": g.model, "choices": [], "usage": usage(replies)})
        yield DONE


class _ChoiceWriter:
    """Turns batches of job events into the bytes of their chunks; ``replies[i]`` once choice i ended."""

    def __init__(self, g: GenRequest, encoder: ChunkEncoder, rendering: Rendering, n: int):
        self.g, self.encoder, self.rendering = g, encoder, rendering
        ex = g.extras
        self.tools = ex.tools if ex.tools is not None and ex.tools.parses else None
        self.splitters = [ToolStream(self.tools, rendering.tool_format) if self.tools else None for _ in range(n)]
        self.replies: list = [None] * n
        self.failed = self.gone = False

    @property
    def finished(self) -> bool:
        """Every choice ended, or one failed or was cancelled."""
        return self.failed or self.gone or all(r is not None for r in self.replies)

    def batch(self, events: list[tuple]) -> bytes:
        """The chunks of ``events``: consecutive text of a choice joined into one chunk."""
        out: list[bytes] = []
        texts: dict[int, tuple[list, list]] = {}  # choice -> (pieces, log-probability entries) not written yet
        for i, what, value in events:
            if what == "text":
                pieces, entries = texts.setdefault(i, ([], []))
                pieces.append(value[0])
                entries.extend(value[1])
                continue
            for k, (pieces, entries) in list(texts.items()):  # everything before this event goes first
                if k == i or what == "error":
                    self._text(out, k, "".join(pieces), entries)
                    del texts[k]
            if what == "end":
                self._end(out, i, value)
            elif what == "error":  # headers are gone: report in-band, as OpenAI does
                out.append(event(http_error_for(value).body()))
                self.failed = True
                return b"".join(out)
            else:
                self.gone = True
                return b""
        for k, (pieces, entries) in texts.items():
            self._text(out, k, "".join(pieces), entries)
        return b"".join(out)

    def _text(self, out: list, i: int, piece: str, entries: list) -> None:
        g = self.g
        if self.splitters[i] is not None:
            piece = self.splitters[i].feed(piece)
        logprobs = _logprobs(g, self.rendering, entries)
        if logprobs:
            out.append(event(self._chunk(text=piece, index=i, logprobs=logprobs)))
        elif piece:
            out.append(self.encoder.text(i, piece))

    def _chunk(self, **kw) -> dict:
        return chunk_body(self.g, self.encoder.rid, self.encoder.created, **kw)

    def _end(self, out: list, i: int, reply) -> None:
        g, finish = self.g, reply.finish_reason
        if self.splitters[i] is not None:
            content, calls = self.splitters[i].finish(self.rendering.full_text(reply))
            if content:
                out.append(event(self._chunk(text=content, index=i)))
            if calls:
                out.append(event(self._chunk(index=i, tool_calls=[c.openai(k) for k, c in enumerate(calls)])))
                finish = "tool_calls" if self.tools.choice != "named" else finish
        final = self._chunk(text=None if g.kind == "chat" else "", finish_reason=finish, index=i)
        final["p2pserve"] = route_info(reply)
        out.append(event(final))
        self.replies[i] = reply


def _logprobs(g: GenRequest, rendering: Rendering, entries: list) -> Optional[dict]:
    """A streamed chunk's log-probabilities (of the tokens since the previous chunk)."""
    if not g.extras.logprobs or not entries:
        return None
    names = TokenNames(rendering.tokenizer, g.extras.token_ids)
    if g.kind == "chat":
        return chat_logprobs(names, entries)
    return completion_logprobs(names, [e.token for e in entries], entries)
