"""The HTTP edge's guards, below the OpenAI app: who may connect, for how long, and with how much.

* :class:`GuardedH11Protocol` — uvicorn's h11 protocol with the timeouts uvicorn lacks: a request
  head must be complete within ``header_timeout_s`` of the connection (or of the previous
  response), and its body within ``body_timeout_s`` (plus a grace, after the app's own 408) or
  the connection is closed. A connection over ``max_connections`` gets a 503 and is closed at
  once, and malformed HTTP (a ``Content-Length: 1_0``) gets a 400 in the OpenAI shape.
* :class:`ApiGuard` — ASGI middleware: the API key (401) and the Content-Length cap (413), both
  before a byte of the body is read. Without a key, a browser is the way in for other sites: a
  page can send a "simple" cross-origin POST (``text/plain``, no preflight) to ``localhost``, or
  rebind its own DNS name to 127.0.0.1 and read the answers. So a keyless server answers only
  requests whose ``Host`` is an IP literal, ``localhost`` or in ``ApiConfig.allowed_hosts``, and
  refuses (403) what a browser marks as cross-site (``Sec-Fetch-Site``) or sends with an
  ``Origin`` other than the server's own.
* :func:`read_body` — the body under the size cap (413 while streaming chunks), the deadline
  (408) and a :class:`BodyBudget` that every body being read shares (503 past it), so that
  stalled bodies cannot pile up in memory.

Errors answered before the body was read in full carry ``Connection: close``: the rest of that
body is never read, so the connection cannot carry another request.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
from typing import Optional

import h11
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from p2pserve.config import ApiConfig
from p2pserve.errors import HTTPError

log = logging.getLogger(__name__)

BODY_GRACE_S = 2.0  # the protocol's backstop waits this much past the app's 408 before closing
CLOSING_STATUSES = {401, 408, 413}  # answered with the body unread (see the module docstring)


class ClientGone(Exception):
    """The HTTP client disconnected; nobody is left to answer."""


def error_response(err: HTTPError, close: bool = False) -> JSONResponse:
    """The OpenAI-shaped JSON response of ``err`` with the headers its status calls for;
    ``close`` when the request's body was not read in full."""
    headers = {}
    if err.status == 429 or err.code == "server_busy":
        headers["Retry-After"] = "1"  # overload passes quickly: a generation ends, a peer frees KV
    if err.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if close or err.status in CLOSING_STATUSES:
        headers["Connection"] = "close"
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _raw_error(status: int, reason: str, err: HTTPError) -> bytes:
    """A whole HTTP/1.1 error response as bytes, for the protocol level (no ASGI there)."""
    body = json.dumps(err.body()).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode("latin-1") + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with head and body deadlines and a connection cap (see the module).

    uvicorn builds one per connection with its own arguments; ``limits`` is bound with
    ``functools.partial`` by :class:`~p2pserve.http.openai.server.OpenAIServer`.
    """

    def __init__(self, *args, limits: ApiConfig, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._deadline: Optional[asyncio.TimerHandle] = None
        self._waiting_for: Optional[str] = None  # "head" or "body": what the deadline is for

    def connection_made(self, transport) -> None:  # type: ignore[override]
        """Accept, or answer 503 and close when ``max_connections`` are open already."""
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            err = HTTPError(503, f"this server has {self.limits.max_connections} connections open; retry later",
                            "service_unavailable", code="too_many_connections")
            transport.write(_raw_error(503, "Service Unavailable", err))
            transport.close()
            return
        self._watch()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        """Drop the deadline with the connection."""
        self._cancel_deadline()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        """uvicorn's event loop over what h11 parsed, then the deadline for what is awaited now."""
        super().handle_events()
        self._watch()

    def on_response_complete(self) -> None:
        """A response went out: the next request's head gets a full ``header_timeout_s``."""
        super().on_response_complete()
        self._waiting_for = None
        self._watch()

    def send_400_response(self, msg: str) -> None:
        """Malformed HTTP (h11 refused it): a 400 in the OpenAI shape, then close."""
        err = HTTPError(400, f"malformed HTTP request: {msg}", code="bad_http")
        # a response already under way (garbage in a body being streamed) cannot get a second one
        answering = self.cycle is None or not self.cycle.response_started
        if answering and not self.transport.is_closing():
            self.transport.write(_raw_error(400, "Bad Request", err))
        self.transport.close()

    # ----------------------------------------------------------------------------- deadlines

    def _watch(self) -> None:
        """Arm the deadline for what the peer has to send next: a head, a body's rest, or nothing."""
        if self.transport is None or self.transport.is_closing():
            self._cancel_deadline()
            return
        state = self.conn.their_state
        want = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if want == self._waiting_for:
            return
        self._cancel_deadline()
        self._waiting_for = want
        if want is not None:
            limit = self.limits.header_timeout_s if want == "head" else self.limits.body_timeout_s + BODY_GRACE_S
            self._deadline = self.loop.call_later(limit, self._expire, want)

    def _expire(self, what: str) -> None:
        self._deadline = None
        if self._waiting_for == what and not self.transport.is_closing():
            # debug only: under a slowloris attack this fires once per attacking connection
            log.debug(f"closing {self.client}: request {what} not complete in time")
            self.transport.close()

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None


# ----------------------------------------------------------------------------- ASGI level


def _header(scope, name: bytes) -> Optional[bytes]:
    return next((v for k, v in scope["headers"] if k == name), None)


class ApiGuard:
    """ASGI middleware in front of the app: the API key on ``/v1/...`` and ``/metrics`` (compared
    in constant time) and the declared body size, both checked before the body is read."""

    def __init__(self, app, limits: ApiConfig):
        self.app = app
        self.limits = limits
        self._expected = f"Bearer {limits.api_key}".encode() if limits.api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            err = self._refusal(scope)
            if err is not None:
                return await error_response(err)(scope, receive, send)
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> Optional[HTTPError]:
        if self._expected is None:
            err = cross_site_refusal(scope, self.limits.allowed_hosts)
            if err is not None:
                return err
        if self._expected is not None and scope["path"].startswith(("/v1", "/metrics")):
            given = _header(scope, b"authorization") or b""
            if not hmac.compare_digest(given, self._expected):
                return HTTPError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
        length = _header(scope, b"content-length")  # h11 let only digits through
        if length is not None and int(length) > self.limits.max_body_bytes:
            return HTTPError(413, f"the request body is {int(length)} bytes; this server takes at most "
                                  f"{self.limits.max_body_bytes}", code="body_too_large")
        return None


def _host_name(value: str) -> str:
    """The host of a ``Host`` header or an origin's authority, without port or brackets."""
    value = value.strip().lower()
    if value.startswith("["):  # [::1]:8000
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def cross_site_refusal(scope, allowed_hosts: tuple[str, ...]) -> Optional[HTTPError]:
    """A 403 for a request a keyless server must not answer (see the module docstring), else None."""
    host = (_header(scope, b"host") or b"").decode("latin-1")
    name = _host_name(host)
    try:
        ipaddress.ip_address(name)
        literal = True
    except ValueError:
        literal = False
    if not (literal or name == "localhost" or name in {h.lower() for h in allowed_hosts}):
        return HTTPError(403, f"Host {host!r} is not served here (a keyless server answers IP addresses, "
                              "localhost and --allowed-host names only)", code="host_not_allowed")
    site = (_header(scope, b"sec-fetch-site") or b"").decode("latin-1").lower()
    origin = (_header(scope, b"origin") or b"").decode("latin-1")
    foreign_origin = origin not in ("", "null") and origin.split("://", 1)[-1].lower() != host.lower()
    if site in ("cross-site", "same-site") or foreign_origin or origin == "null":
        return HTTPError(403, "cross-site requests are refused by a server without an API key",
                         code="cross_site_request")
    return None


class BodyBudget:
    """Bytes of request bodies being read, all requests together, up to ``limit``."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> None:
        """Count ``n`` more bytes, or raise a 503 (nothing taken) when they do not fit."""
        if self.used + n > self.limit:
            raise HTTPError(503, "this server is reading too many request bodies at once; retry later",
                            "service_unavailable", code="server_busy")
        self.used += n

    def give_back(self, n: int) -> None:
        """Return bytes counted by :meth:`take`."""
        self.used -= n


async def read_body(receive, limits: ApiConfig, budget: BodyBudget) -> bytes:
    """The whole request body: 413 past ``max_body_bytes`` (chunked bodies have no length to check
    up front), 408 when it is not complete within ``body_timeout_s``, 503 when ``budget`` has no
    room for it; ClientGone on a disconnect. Its bytes count in ``budget`` only while it is read."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.body_timeout_s
    chunks: list[bytes] = []
    size = 0
    try:
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                raise HTTPError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s",
                                code="request_timeout") from None
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            if size + len(chunk) > limits.max_body_bytes:
                raise HTTPError(413, f"the request body is over {limits.max_body_bytes} bytes", code="body_too_large")
            budget.take(len(chunk))
            size += len(chunk)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
    finally:
        budget.give_back(size)
