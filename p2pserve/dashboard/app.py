"""The dashboard's ASGI app: the page, its static files and ``/api/swarm`` (FastAPI, the stack
the OpenAI API runs on).

* ``GET /`` — ``static/index.html``; ``GET /static/NAME`` for ``dashboard.js``, ``dashboard.css``
  and ``favicon.svg`` (a fixed set of packaged files, read once: no path from the request reaches
  the file system);
* ``GET /api/swarm`` — :meth:`SwarmWatch.document` as JSON.

The page loads no script but its own file: its Content-Security-Policy forbids inline scripts,
other origins and framing, so even a string that slipped past the page's text-only rendering
could not run. :func:`mount_dashboard` puts the same app under ``/dashboard/`` of another app
(``p2pserve api --dashboard``) and ``/api/swarm`` beside it.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from p2pserve.dashboard.watch import SwarmWatch

STATIC = {"index.html": "text/html; charset=utf-8", "dashboard.js": "text/javascript; charset=utf-8",
          "dashboard.css": "text/css; charset=utf-8", "favicon.svg": "image/svg+xml"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"X-Content-Type-Options": "nosniff", "Cache-Control": "no-store", "Referrer-Policy": "no-referrer"}


def static_files() -> dict[str, bytes]:
    """The packaged page files by name (``p2pserve/dashboard/static``)."""
    root = resources.files("p2pserve.dashboard") / "static"
    return {name: (root / name).read_bytes() for name in STATIC}


def _file_response(files: dict[str, bytes], name: str) -> Response:
    headers = dict(HEADERS)
    if name == "index.html":
        headers.update({"Content-Security-Policy": CSP, "X-Frame-Options": "DENY"})
    return Response(files[name], media_type=STATIC[name], headers=headers)


def swarm_endpoint(watch: SwarmWatch):
    """The ``GET /api/swarm`` handler of ``watch``."""
    async def api_swarm(request: Request) -> JSONResponse:
        return JSONResponse(watch.document(), headers=HEADERS)

    return api_swarm


def create_dashboard_app(watch: SwarmWatch) -> FastAPI:
    """The dashboard of ``watch`` as an app of its own (``app.state.watch`` is ``watch``)."""
    files = static_files()
    app = FastAPI(title="p2pserve dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.watch = watch

    async def index(request: Request) -> Response:
        return _file_response(files, "index.html")

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in files or name == "index.html":
            return JSONResponse({"error": f"no such file {name!r}"}, status_code=404, headers=HEADERS)
        return _file_response(files, name)

    app.add_api_route("/", index, methods=["GET"])
    app.add_api_route("/static/{name}", static, methods=["GET"])
    app.add_api_route("/api/swarm", swarm_endpoint(watch), methods=["GET"])
    return app


def mount_dashboard(app: FastAPI, watch: SwarmWatch, prefix: str = "/dashboard") -> None:
    """Serve the dashboard of ``watch`` at ``prefix/`` of ``app``, and its JSON at ``/api/swarm``
    too (the page's own requests are relative, so they stay under ``prefix``)."""
    async def to_slash(request: Request) -> Response:
        return RedirectResponse(prefix + "/", status_code=308)

    app.add_api_route(prefix, to_slash, methods=["GET"])
    app.add_api_route("/api/swarm", swarm_endpoint(watch), methods=["GET"])
    app.mount(prefix, create_dashboard_app(watch))
