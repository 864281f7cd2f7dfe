"""How a stream's events are written: pieces ready together leave in one write, one chunk per
choice, and a text chunk made from its template is the chunk's JSON."""

from __future__ import annotations

import asyncio
import json

import pytest

from p2pserve.http.openai.choices import ChoiceEvents
from p2pserve.http.openai.extras import Rendering
from p2pserve.http.openai.jobs import EventBox, GenerationJob
from p2pserve.http.openai.schema import chunk_body, parse_chat_request, parse_completion_request
from p2pserve.http.openai.sse import ChunkEncoder
from p2pserve.testing import FakeReplyStream

MARK = "\ue000p2pserve-text\ue000"  # what the template holds in place of the text


def request(kind: str, model: str = "fake-model", **extra):
    body = {"model": model, "stream": True, **extra}
    if kind == "chat":
        return parse_chat_request(dict(body, messages=[{"role": "user", "content": "hi"}]), {model})
    return parse_completion_request(dict(body, prompt="hi"), {model})


def events_of(write: bytes) -> list:
    return [json.loads(e[6:]) for e in write.split(b"\n\n") if e and e != b"data: [DONE]"]


def test_pieces_ready_together_leave_in_one_write_one_chunk_per_choice():
    """Two choices whose streams yield "Hello" and " world" without waiting: after the first
    chunks, one write holds each choice's text as one chunk, and its last chunk."""
    g = request("chat", n=2)

    async def go() -> tuple[list[bytes], list]:
        box, ended = EventBox(), []
        jobs = [GenerationJob(FakeReplyStream(), ended.append, box, i) for i in range(2)]
        events = ChoiceEvents(jobs, box)
        assert await events.opened() is None
        return [w async for w in events.sse(g, "chatcmpl-1", 7, Rendering())], ended

    writes, ended = asyncio.run(go())
    assert len(ended) == 2 and len(writes) == 3 and writes[-1] == b"data: [DONE]\n\n"
    assert [c["choices"][0]["delta"] for c in events_of(writes[0])] == [{"role": "assistant", "content": ""}] * 2
    batch = events_of(writes[1])
    texts = [(c["choices"][0]["index"], c["choices"][0]["delta"]["content"]) for c in batch
             if c["choices"][0]["finish_reason"] is None]
    assert sorted(texts) == [(0, "Hello world"), (1, "Hello world")]
    assert sorted(c["choices"][0]["index"] for c in batch if c["choices"][0]["finish_reason"] == "stop") == [0, 1]


def test_a_failing_choice_ends_the_stream_with_its_error_after_the_text_before_it():
    g = request("completion")

    async def go() -> list[bytes]:
        box = EventBox()
        jobs = [GenerationJob(FakeReplyStream(error=RuntimeError("boom")), lambda _: None, box, 0)]
        events = ChoiceEvents(jobs, box)
        assert await events.opened() is None
        return [w async for w in events.sse(g, "cmpl-1", 7, Rendering())]

    writes = asyncio.run(go())
    chunks = [c for w in writes for c in events_of(w)]
    assert chunks[0]["choices"][0]["text"] == "Hello world" and "boom" in chunks[1]["error"]["message"]
    assert writes[-1] == b"data: [DONE]\n\n"


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("model", ["fake-model", f"odd{MARK}name"])
def test_a_text_chunk_from_its_template_is_the_chunks_json(kind, model):
    """Any text, the template's own marker included; a model name holding the marker makes no
    template (the chunk is encoded whole)."""
    g = request(kind, model)
    encoder = ChunkEncoder(g, "id-1", 7)
    for text in ["plain", 'a "quote" and \\ backslash', "line\nbreak\ttab\x00\x1f", "naïve 😀 日本", MARK, ""]:
        for index in (0, 3):
            data = encoder.text(index, text)
            assert data.startswith(b"data: ") and data.endswith(b"\n\n") and data.count(b"\n\n") == 1
            assert json.loads(data[6:]) == chunk_body(g, "id-1", 7, text=text, index=index)
