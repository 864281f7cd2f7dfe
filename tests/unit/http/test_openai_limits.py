"""The OpenAI server under attack, over raw sockets on 127.0.0.1.

Each test runs the real uvicorn server with the fake client and short limits: slow request heads
and stalled bodies are cut off within their timeout, oversized bodies get 413 (by Content-Length
and while streaming chunks), malformed input gets 400 and never a 500, over-long prompts are
refused before tokenising, the key is checked, and a client that goes away cancels its generation.
Timing is asserted only as "within the configured timeout plus slack".
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import asynccontextmanager

import pytest

from p2pserve.http.openai.server import OpenAIServer
from p2pserve.config import ApiConfig
from p2pserve.testing import FakeClient

SLACK_S = 4.0  # a loaded 2-core machine: closing may come this much after the timeout
KEY = "sk-test-0123456789"
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def run(coro):
    return asyncio.run(coro)


@asynccontextmanager
async def serving(client=None, **limits):
    """A started server over ``client`` (a FakeClient by default) with ``limits``; yields its port."""
    server = OpenAIServer(client or FakeClient(), ApiConfig(host="127.0.0.1", port=0, **limits))
    port = await server.start()
    try:
        yield port
    finally:
        await server.close()


async def exchange(port: int, raw: bytes, read_timeout: float = 30.0) -> bytes:
    """Send ``raw`` on a new connection and read until the server closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), read_timeout)
    finally:
        writer.close()


def post(path: str, body: bytes, *headers: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: localhost", f"Content-Length: {len(body)}", "Connection: close", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def json_of(raw: bytes) -> dict:
    return json.loads(raw.partition(b"\r\n\r\n")[2])


async def closed_after(reader: asyncio.StreamReader, limit: float) -> tuple[float, bytes]:
    """Seconds until the server closes the connection (failing past ``limit``), and what it sent."""
    t0 = time.monotonic()
    data = await asyncio.wait_for(reader.read(), limit)
    return time.monotonic() - t0, data


# ----------------------------------------------------------------------------- authentication


def test_a_key_is_required_when_configured():
    async def main():
        async with serving(api_key=KEY) as port:
            body = json.dumps(CHAT).encode()
            missing = await exchange(port, post("/v1/chat/completions", body))
            wrong = await exchange(port, post("/v1/chat/completions", body, "Authorization: Bearer sk-wrong"))
            scheme = await exchange(port, post("/v1/chat/completions", body, f"Authorization: Basic {KEY}"))
            right = await exchange(port, post("/v1/chat/completions", body, f"Authorization: Bearer {KEY}"))
            models = await exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            health = await exchange(port, b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        for raw in (missing, wrong, scheme, models):
            assert status_of(raw) == 401, raw
            err = json_of(raw)["error"]
            assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
        assert status_of(right) == 200 and json_of(right)["choices"][0]["message"]["content"] == "Hello world"
        assert status_of(health) == 200  # for load balancers; it tells nothing about the model's use

    run(main())


def test_without_a_key_the_api_is_open():
    async def main():
        async with serving() as port:
            return await exchange(port, post("/v1/chat/completions", json.dumps(CHAT).encode()))

    assert status_of(run(main())) == 200


# ----------------------------------------------------------------------------- slow and stalled clients


def test_a_request_head_not_complete_in_time_is_closed():
    """Slowloris: a half-sent head, a silent connection, and a head dripped a byte at a time."""
    async def main():
        async with serving(header_timeout_s=1.0) as port:
            half = await asyncio.open_connection("127.0.0.1", port)
            half[1].write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")
            silent = await asyncio.open_connection("127.0.0.1", port)
            drip = await asyncio.open_connection("127.0.0.1", port)

            async def dripping():
                for b in b"GET /v1/models HTTP/1.1\r\nHost: xxxxxxxxxxxxxxxxxxxxxxxx":
                    drip[1].write(bytes([b]))
                    await asyncio.sleep(0.2)

            dripper = asyncio.create_task(dripping())
            waits = [closed_after(r, 1.0 + SLACK_S) for r, _ in (half, silent, drip)]
            results = await asyncio.gather(*waits)
            dripper.cancel()
            for _, w in (half, silent, drip):
                w.close()
            return results

    for elapsed, _ in run(main()):
        assert elapsed < 1.0 + SLACK_S


def test_keep_alive_connections_get_a_fresh_head_timeout_per_request():
    async def main():
        async with serving(header_timeout_s=1.5) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            get = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n"
            statuses = []
            for _ in range(3):  # 3 requests over 3 s on one connection, each well within its timeout
                writer.write(get)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                length = int([l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")][0].split(b":")[1])
                await reader.readexactly(length)
                statuses.append(status_of(head))
                await asyncio.sleep(1.0)
            writer.write(b"GET /v1/mod")  # then a half head: cut off
            elapsed, _ = await closed_after(reader, 1.5 + SLACK_S)
            writer.close()
            return statuses, elapsed

    statuses, elapsed = run(main())
    assert statuses == [200, 200, 200] and elapsed < 1.5 + SLACK_S


def test_a_stalled_body_gets_408_and_is_closed():
    async def main():
        async with serving(body_timeout_s=1.0) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1000\r\n\r\n{\"mod")
            elapsed, raw = await closed_after(reader, 1.0 + SLACK_S)
            writer.close()
            return elapsed, raw

    elapsed, raw = run(main())
    assert elapsed < 1.0 + SLACK_S
    assert status_of(raw) == 408 and json_of(raw)["error"]["code"] == "request_timeout"


# ----------------------------------------------------------------------------- sizes and malformed input


def test_an_oversized_body_by_content_length_gets_413_before_it_is_read():
    async def main():
        async with serving(max_body_bytes=1024) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            # claims 8 MiB and sends none of it: the answer cannot wait for the body
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 8388608\r\n\r\n")
            _, raw = await closed_after(reader, 10)
            writer.close()
            return raw

    raw = run(main())
    assert status_of(raw) == 413 and "1024" in json_of(raw)["error"]["message"]


def test_an_oversized_chunked_body_gets_413_while_streaming():
    async def main():
        async with serving(max_body_bytes=1024) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(8):  # 8 chunks of 200 bytes, and no last chunk: it must not wait for one
                writer.write(b"c8\r\n" + b" " * 200 + b"\r\n")
            _, raw = await closed_after(reader, 10)
            writer.close()
            return raw

    raw = run(main())
    assert status_of(raw) == 413


MALFORMED = {
    "json bomb": post("/v1/chat/completions", b"[" * 200_000),
    "deep object": post("/v1/chat/completions", b'{"a":' * 100_000),
    "closed deep array": post("/v1/completions", b"[" * 50_000 + b"]" * 50_000),
    "not json": post("/v1/chat/completions", b"{not json"),
    "NaN": post("/v1/chat/completions", json.dumps(dict(CHAT, temperature=float("nan"))).encode()),
    "not utf-8": post("/v1/chat/completions", b'{"model": "\xff\xfe"}'),
    "underscore length": b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1_0\r\n\r\n0123456789",
    "negative length": b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: -1\r\n\r\n",
    "two lengths": b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    "bad request line": b"HELLO\r\n\r\n",
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_input_gets_400_not_500(name):
    async def main():
        async with serving() as port:
            return await exchange(port, MALFORMED[name])

    got = run(main())
    assert status_of(got) == 400, (name, got[:300])
    assert json_of(got)["error"]["message"], name


def test_bodies_being_read_share_one_byte_budget():
    """Stalled bodies cannot pile up: past max_inflight_body_bytes, the next body gets 503."""
    async def main():
        async with serving(max_body_bytes=1500, max_inflight_body_bytes=2048) as port:
            first = await asyncio.open_connection("127.0.0.1", port)
            first[1].write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1500\r\n\r\n"
                           + b" " * 1400)  # and stalls
            await asyncio.sleep(0.3)
            second = await exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1500\r\n\r\n"
                                    + b" " * 1400, 10)
            first[1].close()
            await asyncio.sleep(0.3)  # the first body's bytes are given back when its request ends
            third = await exchange(port, post("/v1/completions", json.dumps({"model": "fake-model", "prompt": "p"}).encode()))
            return second, third

    second, third = run(main())
    assert status_of(second) == 503 and json_of(second)["error"]["code"] == "server_busy"
    assert b"retry-after" in second.lower()
    assert status_of(third) == 200


def test_an_over_long_prompt_is_refused_before_tokenising():
    client = FakeClient()

    async def main():
        async with serving(client, max_prompt_chars=1000) as port:
            chat = dict(CHAT, messages=[{"role": "system", "content": "x" * 600}, {"role": "user", "content": "y" * 600}])
            a = await exchange(port, post("/v1/chat/completions", json.dumps(chat).encode()))
            b = await exchange(port, post("/v1/completions", json.dumps({"model": "fake-model", "prompt": "z" * 1001}).encode()))
            c = await exchange(port, post("/v1/completions", json.dumps({"model": "fake-model", "prompt": [7] * 1001}).encode()))
            return a, b, c

    for raw in run(main()):
        assert status_of(raw) == 400 and "1000" in json_of(raw)["error"]["message"]
    assert client.tokenized == [] and client.requests == []


def test_tokenising_does_not_stall_the_event_loop():
    """While one prompt is being tokenised (blocked, here), other requests are answered."""
    gate = threading.Event()
    client = FakeClient(tokenize_gate=gate)

    async def main():
        async with serving(client) as port:
            chat = asyncio.create_task(exchange(port, post("/v1/chat/completions", json.dumps(CHAT).encode())))
            try:
                assert await wait_until(client.tokenizing.is_set)
                models = await exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n", 10)
                still_tokenizing = not chat.done()
            finally:
                gate.set()  # the tokenising thread must not outlive the test
            return models, still_tokenizing, await chat

    models, still_tokenizing, chat = run(main())
    assert status_of(models) == 200 and still_tokenizing
    assert status_of(chat) == 200


# ----------------------------------------------------------------------------- capacity


def test_connections_over_the_cap_get_503():
    async def main():
        async with serving(max_connections=2) as port:
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            await asyncio.sleep(0.2)  # both accepted before the third arrives
            raw = await exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n", 10)
            for _, w in held:
                w.close()
            await asyncio.sleep(0.2)
            after = await exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n", 10)
            return raw, after

    raw, after = run(main())
    assert status_of(raw) == 503 and json_of(raw)["error"]["code"] == "too_many_connections"
    assert status_of(after) == 200


def test_generations_over_the_cap_get_429_with_retry_after():
    client = FakeClient(hold=True)

    async def main():
        async with serving(client, max_generations=1) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(post("/v1/chat/completions", json.dumps(dict(CHAT, stream=True)).encode()))
            await reader.readuntil(b"Hello")  # the first generation is in flight, and holds
            second = await exchange(port, post("/v1/completions", json.dumps({"model": "fake-model", "prompt": "p"}).encode()))
            writer.close()
            return second

    raw = run(main())
    assert status_of(raw) == 429 and b"retry-after: 1" in raw.lower()
    assert json_of(raw)["error"]["type"] == "rate_limit_error"
    assert len(client.streams) == 1


# ----------------------------------------------------------------------------- disconnects


async def wait_until(predicate, limit: float = 10.0) -> bool:
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_cancels_its_generation(stream):
    client = FakeClient(hold=True)

    async def main():
        async with serving(client) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(post("/v1/chat/completions", json.dumps(dict(CHAT, stream=stream)).encode()))
            await writer.drain()
            assert await wait_until(lambda: client.streams and client.streams[0].opened)
            if stream:
                await reader.readuntil(b"Hello")
            writer.close()
            s = client.streams[0]
            assert await wait_until(lambda: s.closed), "the generation was not closed after the disconnect"
            return s

    s = run(main())
    assert s.cancelled and s.closed


def test_closing_the_server_cancels_running_generations():
    client = FakeClient(hold=True)

    async def main():
        server = OpenAIServer(client, ApiConfig(host="127.0.0.1", port=0, shutdown_grace_s=0.5))
        port = await server.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/v1/chat/completions", json.dumps(dict(CHAT, stream=True)).encode()))
        await reader.readuntil(b"Hello")
        await server.close()  # returns once the generation's sessions are closed
        writer.close()
        return client.streams[0]

    s = run(main())
    assert s.cancelled and s.closed
