"""The OpenAI server's HTTP edge with a fake client: status codes, SSE framing, error mapping."""

from __future__ import annotations

import asyncio
import json

import pytest

from p2pserve.http.openai.schema import http_error_for, parse_chat_request, parse_completion_request
from p2pserve.http.openai.server import OpenAIServer
from p2pserve.config import ApiConfig
from p2pserve.errors import (
    AllRoutesOverloadedError,
    BadRequestError,
    GenerationFailedError,
    HTTPError,
    NoRouteError,
    OverloadedError,
)
from p2pserve.testing import FakeClient


async def request(server_client, method, path, body=None):
    server = OpenAIServer(server_client, ApiConfig(host="127.0.0.1", port=0))
    port = await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        data = json.dumps(body).encode() if body is not None else b""
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
                     .encode() + data)
        await writer.drain()
        raw = await reader.read()
        writer.close()
    finally:
        await server.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        payload = dechunk(payload)
    return int(head.split()[1]), head.decode(), payload.decode()


def dechunk(data: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response (streamed responses are sent that way)."""
    out = b""
    while True:
        size, _, rest = data.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return out
        out, data = out + rest[:n], rest[n + 2:]


CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


def run(coro):
    return asyncio.run(coro)


def test_non_streamed_ok():
    status, _, payload = run(request(FakeClient(), "POST", "/v1/chat/completions", CHAT))
    body = json.loads(payload)
    assert status == 200 and body["choices"][0]["message"]["content"] == "Hello world"
    assert body["p2pserve"]["route"] == [{"peer_id": "peerA", "start": 0, "end": 8}]


def test_streamed_sse_framing():
    status, head, payload = run(request(FakeClient(), "POST", "/v1/chat/completions", dict(CHAT, stream=True)))
    assert status == 200 and "text/event-stream" in head
    events = [e[len("data: "):] for e in payload.strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Hello world"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("error,status", [
    (NoRouteError("no usable peer serves layer 4"), 503),
    (NoRouteError("every route passes an overloaded peer", overloaded=True), 429),
    (AllRoutesOverloadedError("x"), 429),
    (GenerationFailedError("gave up"), 503),
    (BadRequestError("prompt too long"), 400),
    (RuntimeError("bug"), 500),
])
def test_errors_map_to_status_codes_streamed_or_not(error, status):
    for body in (CHAT, dict(CHAT, stream=True)):
        got, _, payload = run(request(FakeClient(error=error), "POST", "/v1/chat/completions", body))
        assert got == status
        assert json.loads(payload)["error"]["message"]


def test_error_after_streaming_started_is_reported_in_band():
    status, _, payload = run(request(FakeClient(stream_error=GenerationFailedError("peer died")), "POST",
                                     "/v1/chat/completions", dict(CHAT, stream=True)))
    assert status == 200
    assert '"error"' in payload and "peer died" in payload and payload.strip().endswith("[DONE]")


def test_unknown_path_and_method():
    status, _, payload = run(request(FakeClient(), "GET", "/v2/nothing"))
    assert status == 404 and json.loads(payload)["error"]["code"] == "not_found"
    status, _, payload = run(request(FakeClient(), "GET", "/v1/chat/completions"))
    assert status == 405 and "Method Not Allowed" in json.loads(payload)["error"]["message"]
    status, _, payload = run(request(FakeClient(), "GET", "/v1/models"))
    assert status == 200 and json.loads(payload)["data"][0]["id"] == "fake-model"


def test_parse_chat_request_validation():
    models = {"m"}
    ok = parse_chat_request({"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "x"}]}],
                             "max_completion_tokens": 5, "stop": "END", "seed": 3}, models)
    assert ok.messages == [{"role": "system", "content": "x"}]
    assert ok.params.max_new_tokens == 5 and ok.params.stop == ("END",) and ok.params.seed == 3
    for bad, needle in [
        ({"messages": [{"role": "user", "content": "x"}]}, "'model' is required"),
        ({"model": "m"}, "'messages' is required"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}, "integer"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 17}, "'n'"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "content"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 7}, "temperature"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_k": -2}, "top_k"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
         "'max_completion_tokens' must be >= 1"),
    ]:
        with pytest.raises(HTTPError) as e:
            parse_chat_request(bad, models)
        assert e.value.status == 400 and needle in e.value.message, bad


def test_overloaded_remote_error_is_429():
    assert http_error_for(OverloadedError("full", peer="p")).status == 429


def test_the_request_reaches_the_client_as_generation_params():
    """The server hands the client the GenerationParams it validated (one owner of parameters)."""
    client = FakeClient()
    body = dict(CHAT, max_tokens=7, top_k=3, seed=-1, stop=["x"])
    assert run(request(client, "POST", "/v1/chat/completions", body))[0] == 200
    (ids, params), = client.requests
    assert client.tokenized == [[{"role": "user", "content": "hi"}]] and ids == [1, 2, 3]
    assert (params.max_new_tokens, params.top_k, params.stop) == (7, 3, ("x",))
    assert params.seed == (1 << 62) - 1  # negative seeds are folded into ours
    completion = parse_completion_request({"model": "m", "prompt": [[1, 2, 3]]}, {"m"})
    assert completion.prompt == [1, 2, 3] and completion.params.temperature == 1.0
