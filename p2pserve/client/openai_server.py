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
translation (:func:`parse_chat_request`, :func:`completion_body`, ...) is pure and unit-testable.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from p2pserve.errors import (
    AllRoutesOverloadedError,
    HTTPError,
    BadRequestError,
    ConfigError,
    GenerationFailedError,
    OverloadedError,
    P2PServeError,
    RoutingError,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
MAX_HEADER_BYTES = 64 << 10
DEFAULT_MAX_TOKENS = 256




def http_error_for(exc: BaseException) -> HTTPError:
    """Map a p2pserve exception to the HTTP status a client can act on."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, (BadRequestError, ConfigError)):
        msg = exc.message if isinstance(exc, BadRequestError) else str(exc)
        return HTTPError(400, msg)
    if isinstance(exc, (AllRoutesOverloadedError, OverloadedError)) or (
        isinstance(exc, RoutingError) and getattr(exc, "overloaded", False)
    ):
        return HTTPError(429, f"every route is overloaded, retry later: {exc}", "rate_limit_error", code="overloaded")
    if isinstance(exc, RoutingError):
        return HTTPError(503, f"no route through the swarm: {exc}", "service_unavailable", code="no_route")
    if isinstance(exc, GenerationFailedError):
        return HTTPError(503, str(exc), "service_unavailable", code="generation_failed")
    if isinstance(exc, P2PServeError):
        return HTTPError(500, str(exc), "server_error")
    return HTTPError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


# ----------------------------------------------------------------------------- request parsing (pure)


@dataclass
class GenRequest:
    """What a chat or completion request asks for, validated."""

    kind: str  # "chat" or "completion"
    model: str
    messages: Optional[list] = None
    prompt: Any = None
    stream: bool = False
    include_usage: bool = False
    kwargs: dict = field(default_factory=dict)  # max_new_tokens, temperature, top_p, top_k, seed, stop


def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise HTTPError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}", param=name)
    if not lo <= value <= hi:
        raise HTTPError(400, f"'{name}' must be in [{lo:g}, {hi:g}], got {value!r}", param=name)
    return value


def parse_common(body: dict, models: set[str], kind: str) -> GenRequest:
    """Fields shared by /v1/chat/completions and /v1/completions."""
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise HTTPError(400, "'model' is required (see GET /v1/models)", param="model")
    if model not in models:
        raise HTTPError(400, f"unknown model {model!r}; this server serves {sorted(models)}", param="model",
                        code="model_not_found")
    limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, limit_name, DEFAULT_MAX_TOKENS, 1, 1 << 20, integer=True)
    n = _number(body, "n", 1, 1, 1, integer=True)
    del n  # one choice per request (n > 1 is rejected above with a clear message)
    temperature = _number(body, "temperature", 1.0, 0, 2)
    top_p = _number(body, "top_p", 1.0, 1e-9, 1)
    top_k = _number(body, "top_k", 0, 0, 1 << 20, integer=True)
    seed = _number(body, "seed", None, -(1 << 62), 1 << 62, integer=True)
    if seed is not None and seed < 0:
        seed = seed & ((1 << 62) - 1)
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
            raise HTTPError(400, "'stop' must be a string or a list of up to 16 non-empty strings", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise HTTPError(400, "'stream' must be a boolean", param="stream")
    opts = body.get("stream_options") or {}
    include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
    kwargs = dict(max_new_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
                  seed=seed, stop=stop)
    return GenRequest(kind=kind, model=model, stream=stream, include_usage=include_usage, kwargs=kwargs)


def parse_chat_request(body: dict, models: set[str]) -> GenRequest:
    """Validate a /v1/chat/completions body."""
    req = parse_common(body, models, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "'messages' is required: a non-empty list of {role, content}", param="messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise HTTPError(400, f"messages[{i}] must be an object", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # the content-parts form: keep the text parts
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                raise HTTPError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(parts)
        if not isinstance(content, str):
            raise HTTPError(400, f"messages[{i}].content must be a string", param="messages")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise HTTPError(400, f"messages[{i}].role must be system, user or assistant, got {role!r}", param="messages")
        clean.append({"role": role, "content": content})
    req.messages = clean
    return req


def parse_completion_request(body: dict, models: set[str]) -> GenRequest:
    """Validate a /v1/completions body (prompt: a string, token ids, or a one-element list of either)."""
    req = parse_common(body, models, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    ok = (isinstance(prompt, str) and prompt) or (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )
    if not ok:
        raise HTTPError(400, "'prompt' is required: a non-empty string or list of token ids (one prompt per request)",
                        param="prompt")
    if body.get("echo"):
        raise HTTPError(400, "'echo' is not supported", param="echo")
    req.prompt = prompt
    return req


def usage(reply) -> dict:
    """OpenAI usage object of a finished Reply."""
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": len(reply.tokens),
            "total_tokens": reply.prompt_tokens + len(reply.tokens)}


def route_info(reply) -> dict:
    """A p2pserve extension field: the route(s) taken and timings."""
    return {
        "route": [{"peer_id": h.peer_id, "start": h.start, "end": h.end} for h in reply.route],
        "routes": len(reply.routes),
        "failures": reply.failures,
        "tokens_per_s": round(reply.tokens_per_s, 3),
        "time_to_first_token_s": None if reply.first_token_s is None else round(reply.first_token_s, 4),
    }


def completion_body(req: GenRequest, reply, rid: str, created: int) -> dict:
    """The non-streaming response body."""
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": reply.text}, "logprobs": None,
                  "finish_reason": reply.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": reply.text, "logprobs": None, "finish_reason": reply.finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice],
            "usage": usage(reply), "p2pserve": route_info(reply)}


def chunk_body(req: GenRequest, rid: str, created: int, text: Optional[str] = None, role: bool = False,
               finish_reason: Optional[str] = None) -> dict:
    """One streamed chunk."""
    if req.kind == "chat":
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice]}


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
            reply = await (c.chat(g.messages, **g.kwargs) if g.kind == "chat" else c.generate(g.prompt, **g.kwargs))
            await self._send_json(writer, 200, completion_body(g, reply, rid, created))
            return True
        # Streaming: validate and open the route first, so that 400/429/503 are still possible.
        stream = c.chat_stream(g.messages, **g.kwargs) if g.kind == "chat" else c.generate_stream(g.prompt, **g.kwargs)
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
