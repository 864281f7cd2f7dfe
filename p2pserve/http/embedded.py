"""``EmbeddedServer``: one ASGI app served by uvicorn inside the caller's event loop, behind the
guarded h11 protocol of :mod:`p2pserve.http.guard` (the OpenAI API and the dashboard both use it).

uvicorn runs on a socket bound here, so ``port=0`` reports the port it got and a port in use is a
``ConfigError``, not uvicorn's ``sys.exit``. It installs no SIGINT/SIGTERM handlers: the command
that owns the loop decides when to stop. Every bound comes from one
:class:`~p2pserve.config.ApiConfig`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from typing import Any, Optional

import uvicorn

from p2pserve.config import ApiConfig
from p2pserve.errors import ConfigError
from p2pserve.http.guard import GuardedH11Protocol


class _QuietServer(uvicorn.Server):
    """uvicorn's server without its signal handlers (it would replace the command's own)."""

    @contextlib.contextmanager
    def capture_signals(self):
        """Install nothing: :meth:`EmbeddedServer.close` stops the server."""
        yield


def bind(host: str, port: int, what: str = "") -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6, as ``host`` resolves); ``what``
    names the server in the error."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise ConfigError(f"{what}cannot listen on {host}:{port}: {e}") from e


def uvicorn_config(app: Any, limits: ApiConfig, graceful_shutdown: bool = True) -> uvicorn.Config:
    """uvicorn's settings for ``app`` under ``limits`` (``graceful_shutdown``: give running
    requests ``limits.shutdown_grace_s`` when stopping)."""
    extra = {"timeout_graceful_shutdown": limits.shutdown_grace_s} if graceful_shutdown else {}
    return uvicorn.Config(
        app,
        http=functools.partial(GuardedH11Protocol, limits=limits),
        ws="none",
        lifespan="off",
        log_config=None,  # keep the command's logging as it is
        access_log=False,
        server_header=False,
        # GuardedH11Protocol answers a connection over max_connections with 503 when it is
        # accepted; uvicorn's own check (>= limit, counting the connection asking) would refuse
        # one sooner, so it gets one more and stays a backstop for piled-up request tasks.
        limit_concurrency=limits.max_connections + 1,
        timeout_keep_alive=limits.keep_alive_s,
        h11_max_incomplete_event_size=limits.max_header_bytes,
        **extra,
    )


class EmbeddedServer:
    """Serves one ASGI app (given in the ``uvicorn.Config``) on a bound socket in the running loop until :meth:`close`."""

    def __init__(self, what: str = "the HTTP server"):
        self.what = what
        self.port: Optional[int] = None
        self._server: Optional[_QuietServer] = None
        self._serving: Optional[asyncio.Task] = None

    async def start(self, host: str, sock: socket.socket, config: uvicorn.Config) -> int:
        """Serve on ``sock`` (from :func:`bind` on ``host``) with ``config``; returns once
        connections are accepted, with the port."""
        self.port = sock.getsockname()[1]
        self._server = _QuietServer(config)
        self._serving = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:  # uvicorn sets it once it accepts connections
            if self._serving.done():
                self._serving.result()  # raises what stopped it
                raise ConfigError(f"{self.what} on {host}:{self.port} stopped while starting")
            await asyncio.sleep(0.01)
        return self.port

    async def close(self) -> None:
        """Stop listening and wait for uvicorn's shutdown (its graceful period, if configured)."""
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._serving
        self._server = self._serving = None
