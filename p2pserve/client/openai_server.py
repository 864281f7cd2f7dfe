"""The OpenAI-compatible HTTP server: the FastAPI app of :mod:`p2pserve.client.openai_app` served
by uvicorn inside the caller's event loop (the loop the ``AsyncClient`` runs on).

uvicorn runs on a socket bound here (so ``port=0`` reports the port it got, and a port in use is
a ``ConfigError``, not uvicorn's ``sys.exit``), with :class:`~p2pserve.client.http_guard.GuardedH11Protocol`
for the head and body timeouts and the connection cap, and without taking over SIGINT/SIGTERM:
the command that owns the loop decides when to stop. Every bound comes from one
:class:`~p2pserve.config.ApiConfig`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
from typing import Optional

import uvicorn

from p2pserve.client.http_guard import GuardedH11Protocol
from p2pserve.client.openai_app import create_app
from p2pserve.config import ApiConfig
from p2pserve.errors import ConfigError

log = logging.getLogger(__name__)


class _EmbeddedServer(uvicorn.Server):
    """uvicorn's server without its signal handlers (it would replace the command's own)."""

    @contextlib.contextmanager
    def capture_signals(self):
        """Install nothing: :meth:`OpenAIServer.close` stops the server."""
        yield


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6, as ``host`` resolves)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e}") from e


class OpenAIServer:
    """Serves the OpenAI API for one started ``AsyncClient`` (see :mod:`p2pserve.client.openai_app`)."""

    def __init__(self, client, config: ApiConfig = ApiConfig(), clock=time.time):
        self.config = config
        self.app = create_app(client, config, clock)
        self.port: Optional[int] = None
        self._server: Optional[_EmbeddedServer] = None
        self._serving: Optional[asyncio.Task] = None

    @property
    def primary_model(self) -> str:
        """The first served model name (the checkpoint id without one)."""
        return self.app.state.api.primary_model

    def _uvicorn_config(self) -> uvicorn.Config:
        cfg = self.config
        return uvicorn.Config(
            self.app,
            http=functools.partial(GuardedH11Protocol, limits=cfg),
            ws="none",
            lifespan="off",
            log_config=None,  # keep the command's logging as it is
            access_log=False,
            server_header=False,
            # GuardedH11Protocol answers a connection over max_connections with 503 when it is
            # accepted; uvicorn's own check (>= limit, counting the connection asking) would refuse
            # one sooner, so it gets one more and stays a backstop for piled-up request tasks.
            limit_concurrency=cfg.max_connections + 1,
            timeout_keep_alive=cfg.keep_alive_s,
            h11_max_incomplete_event_size=cfg.max_header_bytes,
            timeout_graceful_shutdown=cfg.shutdown_grace_s,
        )

    async def start(self) -> int:
        """Listen on ``config.host:config.port``; returns the port (useful with port 0)."""
        cfg = self.config
        sock = _bind(cfg.host, cfg.port)
        self.port = sock.getsockname()[1]
        self._server = _EmbeddedServer(self._uvicorn_config())
        self._serving = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:  # uvicorn sets it once it accepts connections
            if self._serving.done():
                self._serving.result()  # raises what stopped it
                raise ConfigError(f"the HTTP server on {cfg.host}:{self.port} stopped while starting")
            await asyncio.sleep(0.01)
        if cfg.api_key is None:
            log.warning(f"no API key: anyone who can reach {cfg.host}:{self.port} may use this API "
                        "(give --api-key or P2PSERVE_API_KEY)")
        return self.port

    async def close(self) -> None:
        """Stop listening; running requests get ``shutdown_grace_s`` to finish, then are cancelled,
        and so are their generations (whose swarm sessions are closed before this returns)."""
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._serving
        await self.app.state.api.aclose()
        self._server = self._serving = None
