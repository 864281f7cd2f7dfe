"""The OpenAI API as a FastAPI app over an ``AsyncClient``.

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with
``"stream": true`` as server-sent events, ending in ``data: [DONE]``), ``GET /health``, and
``GET /metrics``: the client's Prometheus series (``docs/metrics.md``), behind the API key when
one is set.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:

* 400 — bad input: malformed HTTP or JSON (deep nesting included), missing/invalid ``messages``
  or ``prompt``, out-of-range parameters, a prompt over ``max_prompt_chars`` (refused before
  tokenising) or longer than the context;
* 404 ``model_not_found`` — an unknown ``model`` (as OpenAI and vLLM answer it);
* 401 — a key is configured and the request does not carry it;
* 404 unknown path, 405 wrong method, 408 body too slow, 413 body too large;
* 429 (with ``Retry-After``) — every route goes through an overloaded peer, or this server
  already runs ``max_generations`` generations;
* 503 — no route exists (a layer is not served), failover gave up, ``max_connections`` are open,
  or the bodies being read fill ``max_inflight_body_bytes`` (with ``Retry-After``);
* 500 — anything else (a bug: the message says what).

The fields beyond plain text (``n``, log-probabilities, ``echo``, tools, ``response_format``) are
parsed in ``http/openai/extras.py`` and their choices run and stream through ``http/openai/choices.py``
(docs/openai-api.md). Each generation runs in a task of its own (:class:`GenerationJob`,
``http/openai/jobs.py``) that always closes its swarm sessions when it ends; a stream's jobs
put their text in one box that its writer empties in batches, one write each
(``http/openai/sse.py`` encodes them). A watcher waits for the HTTP client's disconnect and cancels the job, so
a client that goes away stops its generation, streamed or not. Prompts are tokenised on one
worker thread, off the event loop, where a long one cannot stall other connections and hops.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from fastapi import FastAPI, Request
from prometheus_client import make_asgi_app
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from p2pserve.http.guard import ApiGuard, BodyBudget, ClientGone, error_response, read_body
from p2pserve.http.openai.choices import ChoiceEvents, prepare_request, start_choices
from p2pserve.http.openai.jobs import EventBox, GenerationJob
from p2pserve.http.openai.extras import Rendering, sampling_defaults
from p2pserve.http.openai.schema import GenRequest, completion_body, http_error_for, parse_request_body
from p2pserve.config import ApiConfig
from p2pserve.errors import HTTPError
from p2pserve.metrics import ClientMetrics

log = logging.getLogger(__name__)


async def _cancel_on_disconnect(receive, jobs: list[GenerationJob]) -> None:
    """Cancel ``jobs`` when the HTTP client disconnects (the request body was read in full, so the
    next ASGI message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    for job in jobs:
        job.cancel()


class EventStream(StreamingResponse):
    """Server-sent events, written without Starlette's disconnect listener: that one cancels the
    writer inside an anyio cancel scope, where closing the swarm sessions would be cancelled too.
    The job's own watcher handles the disconnect; ``cleanup`` runs however the stream ends. Each
    bytes object ``events`` yields (a batch of events) is one write."""

    def __init__(self, events, cleanup):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.body_iterator.aclose()
            self._cleanup()


class OpenAIApi:
    """The endpoints, over one started ``AsyncClient`` (or ``p2pserve.testing.FakeClient``)."""

    def __init__(self, client, limits: ApiConfig, clock=time.time):
        self.client = client
        self.limits = limits
        self.clock = clock
        names = limits.served_model_names
        self.models = {client.model_id, *names}
        self.primary_model = names[0] if names else client.model_id
        self.jobs: set[GenerationJob] = set()  # in flight, at most limits.max_generations
        self._starting = 0  # requests past the generation cap check, still tokenising
        self.bodies = BodyBudget(limits.max_inflight_body_bytes)
        self.rendering = Rendering.of(client)  # tokenizer and tool-call format, for log-probabilities and tools
        self.defaults = sampling_defaults(getattr(getattr(client, "info", None), "path", None))
        # One thread: the tokenizer is not meant for concurrent calls, and one worker bounds
        # the CPU that tokenising takes from the peers sharing this machine.
        self._tokenizer = ThreadPoolExecutor(1, thread_name_prefix="p2pserve-tokenize")

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """Cancel the generations still running and wait (up to ``timeout_s``) until their swarm
        sessions are closed, so that the client can be closed after; stop the tokenising thread."""
        for job in list(self.jobs):
            job.cancel()
        if self.jobs:
            await asyncio.wait([job.task for job in self.jobs], timeout=timeout_s)
        self._tokenizer.shutdown(wait=False, cancel_futures=True)

    async def list_models(self, request: Request) -> JSONResponse:
        """``GET /v1/models``."""
        created = int(self.clock())
        # p2pserve's field: the checkpoint's generation_config sampling fields, used where a request leaves them out
        data = [{"id": m, "object": "model", "created": created, "owned_by": "p2pserve",
                 "p2pserve": {"sampling_defaults": self.defaults}} for m in sorted(self.models)]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> JSONResponse:
        """``GET /health`` (no key needed: it says nothing a request could use)."""
        return JSONResponse({"status": "ok", "model": self.primary_model})

    async def chat(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        return await self._serve(request, "chat")

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        return await self._serve(request, "completion")

    async def _serve(self, request: Request, kind: str) -> Response:
        try:
            raw = await read_body(request.receive, self.limits, self.bodies)
        except ClientGone:
            return Response(status_code=204)  # nobody reads it: uvicorn drops it
        except HTTPError as e:
            return error_response(e, close=True)  # the rest of the body stays unread
        try:
            g = parse_request_body(raw, kind, self.models, self.limits.max_prompt_chars, self.defaults)
            box = EventBox() if g.stream else None  # a non-streamed reply only needs each job's end
            jobs = await self._start(g, box)
        except Exception as e:  # the HTTP edge: every failure becomes a typed error response
            return self._failure(request, e)
        watchers = [asyncio.create_task(_cancel_on_disconnect(request.receive, jobs))]
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(self.clock())
        if not g.stream:
            try:
                outcomes = [await job.outcome() for job in jobs]
            finally:
                for w in watchers:
                    w.cancel()
                for job in jobs:
                    job.cancel()
            for what, value in outcomes:
                if what != "end":
                    return self._failure(request, value if what == "error" else ClientGone())
            return JSONResponse(completion_body(g, [v for _, v in outcomes], rid, created, self.rendering))
        return await self._stream(request, g, jobs, box, watchers[0], rid, created)

    async def _start(self, g: GenRequest, box: Optional[EventBox]) -> list[GenerationJob]:
        """Take a generation slot per choice (429 when too few are free), tokenise and compile
        any grammar off the loop, start the jobs."""
        n = g.extras.n
        if self._starting + len(self.jobs) + n > self.limits.max_generations:
            raise HTTPError(429, f"this server already runs {self.limits.max_generations} generations; retry later",
                            "rate_limit_error", code="too_many_generations")
        self._starting += n  # holds the slots while tokenising
        try:
            loop = asyncio.get_running_loop()
            ids, params = await loop.run_in_executor(self._tokenizer, prepare_request, self.client, g)
            g.prompt_ids = ids
            jobs = start_choices(self.client, ids, params, n,
                                 lambda s, i, after: GenerationJob(s, self.jobs.discard, box, i, after))
            self.jobs.update(jobs)
            return jobs
        finally:
            self._starting -= n

    async def _stream(self, request, g: GenRequest, jobs: list, box: EventBox, watcher, rid: str,
                      created: int) -> Response:
        """Open the routes first, so that 400/429/503 are still possible; then stream events."""
        def cleanup() -> None:
            watcher.cancel()
            for job in jobs:
                job.cancel()

        events = ChoiceEvents(jobs, box)
        try:
            failure = await events.opened()
        except BaseException:  # this request is being cancelled (shutdown): so is its generation
            cleanup()
            raise
        if failure is not None:
            cleanup()
            what, value = failure
            return self._failure(request, value if what == "error" else ClientGone())
        return EventStream(events.sse(g, rid, created, self.rendering), cleanup)

    def _failure(self, request: Request, exc: BaseException) -> JSONResponse:
        if isinstance(exc, ClientGone):
            exc = HTTPError(503, "the generation was cancelled", "service_unavailable", code="cancelled")
        err = http_error_for(exc)
        if err.status >= 500:
            log.warning(f"{request.method} {request.url.path}: {err.status} {err.message}")
        return error_response(err)


class _Metrics:
    """prometheus-client's ASGI app at exactly ``/metrics`` (a Starlette ``Mount`` would answer
    ``/metrics/`` only, and redirect ``/metrics`` there); an object, not a function, so that the
    route hands it the raw ASGI call."""

    def __init__(self, registry):
        self.app = make_asgi_app(registry)

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Routing errors (404, 405) in the OpenAI shape."""
    if exc.status_code == 404:
        err = HTTPError(404, f"no such endpoint {request.url.path}; try /v1/chat/completions", code="not_found")
    else:
        err = HTTPError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    return error_response(err)


def create_app(client, limits: ApiConfig = ApiConfig(), clock=time.time) -> FastAPI:
    """The FastAPI app serving ``client``; ``app.state.api`` is its :class:`OpenAIApi`."""
    api = OpenAIApi(client, limits, clock)
    app = FastAPI(title="p2pserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.api = api
    app.add_api_route("/v1/models", api.list_models, methods=["GET"])
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    # the client's series; a stand-in client without any gets an empty set, still scrapable
    metrics = getattr(client, "metrics", None) or ClientMetrics()
    app.router.routes.append(Route("/metrics", _Metrics(metrics.registry), methods=["GET"]))
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_middleware(ApiGuard, limits=limits)
    return app
