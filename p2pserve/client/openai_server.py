"""An OpenAI-compatible HTTP server over an ``AsyncClient`` (stdlib asyncio only).

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with
``"stream": true`` as server-sent events, ending in ``data: [DONE]``), and ``GET /health``.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:

* 400 — bad input: malformed JSON, missing/invalid ``messages`` or ``prompt``, negative or
  non-integer token limits, out-of-range sampling parameters, an unknown ``model``, a prompt
  longer than the context;
* 404 unknown path, 405 wrong method, 413 body too large;
* 429 — every route goes through an overloaded peer (try again later);
* 503 — no route exists (a layer is not served), or failover gave up;
* 500 — anything else (a bug: the message says what).

The HTTP layer is deliberately small: HTTP/1.1 with keep-alive for ordinary responses and
``Connection: close`` after a stream (so no chunked encoding is needed). The request → reply
translation (:func:`~p2pserve.client.openai_schema.parse_chat_request`, ``completion_body``,
...) is pure and lives in :mod:`p2pserve.client.openai_schema`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Optional

from p2pserve.client.openai_schema import (
    GenRequest,
    chunk_body,
    completion_body,
    http_error_for,
    parse_chat_request,
    parse_completion_request,
    route_info,
    usage,
)
from p2pserve.errors import HTTPError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
MAX_HEADER_BYTES = 64 << 10


# ----------------------------------------------------------------------------- HTTP shell


@dataclass
class HTTPRequest:
    """A parsed HTTP request."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def keep_alive(self) -> bool:
        return self.headers.get("connection", "").lower() != "close"


async def read_request(reader: asyncio.StreamReader) -> Optional[HTTPRequest]:
    """Read one request (None at a clean EOF between requests)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if not e.partial.strip():
            return None
        raise HTTPError(400, "incomplete HTTP request")
    except asyncio.LimitOverrunError:
        raise HTTPError(413, "request headers too large")
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, target, _version = lines[0].split(" ", 2)
    except ValueError:
        raise HTTPError(400, "malformed request line")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        raise HTTPError(411, "chunked request bodies are not supported; send Content-Length")
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise HTTPError(400, "bad Content-Length")
    if length < 0 or length > MAX_BODY_BYTES:
        raise HTTPError(413, f"request body over {MAX_BODY_BYTES} bytes")
    body = await reader.readexactly(length) if length else b""
    return HTTPRequest(method.upper(), target.split("?", 1)[0], headers, body)


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 411: "Length Required",
            413: "Payload Too Large", 429: "Too Many Requests", 500: "Internal Server Error",
            503: "Service Unavailable"}


def response_head(status: int, headers: dict[str, str]) -> bytes:
    """Status line and headers."""
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class OpenAIServer:
    """Serves the OpenAI API for one started ``AsyncClient``.

    ``model_names`` are the names requests may use (the checkpoint id is always accepted).
    """

    def __init__(self, client, model_names: tuple[str, ...] = (), clock=time.time):
        self.client = client
        self.clock = clock
        self.models = {client.model_id, *model_names}
        self.primary_model = model_names[0] if model_names else client.model_id
        self._server: Optional[asyncio.AbstractServer] = None
        self.port: Optional[int] = None

    async def start(self, host: str = "127.0.0.1", port: int = 8000) -> int:
        """Listen; returns the port (useful with port 0)."""
        self._server = await asyncio.start_server(self._handle, host, port, limit=MAX_HEADER_BYTES)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def serve_forever(self) -> None:
        """Serve until cancelled."""
        async with self._server:
            await self._server.serve_forever()

    async def close(self) -> None:
        """Stop listening."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    req = await read_request(reader)
                except HTTPError as e:
                    await self._send_json(writer, e.status, e.body(), keep_alive=False)
                    return
                if req is None:
                    return
                keep = await self._dispatch(req, writer)
                if not (keep and req.keep_alive):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        finally:
            try:
                writer.close()
            except Exception:
                pass

    async def _dispatch(self, req: HTTPRequest, writer) -> bool:
        """Answer one request; returns whether the connection may be reused."""
        routes = {
            "/v1/models": ("GET", self._models),
            "/health": ("GET", self._health),
            "/v1/chat/completions": ("POST", self._chat),
            "/v1/completions": ("POST", self._completions),
        }
        try:
            if req.path not in routes:
                raise HTTPError(404, f"no such endpoint {req.path}; try /v1/chat/completions", code="not_found")
            method, handler = routes[req.path]
            if req.method != method:
                raise HTTPError(405, f"{req.path} expects {method}")
            return await handler(req, writer)
        except Exception as e:  # the HTTP edge: every failure becomes a typed error response
            err = http_error_for(e)
            if err.status >= 500:
                log.warning(f"{req.method} {req.path}: {err.status} {err.message}")
            await self._send_json(writer, err.status, err.body())
            return True

    async def _send_json(self, writer, status: int, body: dict, keep_alive: bool = True) -> None:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "Content-Length": str(len(data)),
                   "Connection": "keep-alive" if keep_alive else "close"}
        writer.write(response_head(status, headers) + data)
        await writer.drain()

    def _json_body(self, req: HTTPRequest) -> dict:
        try:
            body = json.loads(req.body or b"null")
        except (ValueError, UnicodeDecodeError) as e:
            raise HTTPError(400, f"the body is not valid JSON: {e}")
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        return body

    async def _models(self, req, writer) -> bool:
        created = int(self.clock())
        data = [{"id": m, "object": "model", "created": created, "owned_by": "p2pserve"} for m in sorted(self.models)]
        await self._send_json(writer, 200, {"object": "list", "data": data})
        return True

    async def _health(self, req, writer) -> bool:
        await self._send_json(writer, 200, {"status": "ok", "model": self.primary_model})
        return True

    async def _chat(self, req, writer) -> bool:
        return await self._generate(parse_chat_request(self._json_body(req), self.models), writer)

    async def _completions(self, req, writer) -> bool:
        return await self._generate(parse_completion_request(self._json_body(req), self.models), writer)

    async def _generate(self, g: GenRequest, writer) -> bool:
        c = self.client
        rid = ("chatcmpl-" if g.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(self.clock())
        if not g.stream:
            reply = await (c.chat(g.messages, params=g.params) if g.kind == "chat" else c.generate(g.prompt, params=g.params))
            await self._send_json(writer, 200, completion_body(g, reply, rid, created))
            return True
        # Streaming: validate and open the route first, so that 400/429/503 are still possible.
        stream = (c.chat_stream(g.messages, params=g.params) if g.kind == "chat"
                  else c.generate_stream(g.prompt, params=g.params))
        await stream.open()
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "close"}
        writer.write(response_head(200, headers))

        async def event(obj) -> None:
            writer.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            await writer.drain()

        try:
            if g.kind == "chat":
                await event(chunk_body(g, rid, created, text="", role=True))
            async for piece in stream:
                await event(chunk_body(g, rid, created, text=piece))
            reply = stream.reply
            final = chunk_body(g, rid, created, text=None if g.kind == "chat" else "", finish_reason=reply.finish_reason)
            final["p2pserve"] = route_info(reply)
            await event(final)
            if g.include_usage:
                await event({"id": rid, "object": final["object"], "created": created, "model": g.model,
                             "choices": [], "usage": usage(reply)})
        except (ConnectionError, asyncio.CancelledError):
            await stream.aclose()
            raise
        except Exception as e:  # headers are gone: report in-band, as OpenAI does
            await stream.aclose()
            await event(http_error_for(e).body())
        writer.write(b"data: [DONE]\n\n")
        await writer.drain()
        return False
