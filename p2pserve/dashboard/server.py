"""``DashboardServer``: the dashboard app on uvicorn inside the caller's event loop, next to the
:class:`SwarmWatch` loop that feeds it (``p2pserve status --web``, ``coordinator --web-port``).

Connections go through the API's guarded h11 protocol (``client/http_guard.py``) with the
default ``ApiConfig`` bounds: a head within 10 s, 256 connections. uvicorn gets a socket bound
here, so ``port=0`` reports the port it got and a port in use is a ``ConfigError``; it installs
no signal handlers (the command owns SIGINT/SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from typing import Optional

import uvicorn

from p2pserve.client.http_guard import ApiGuard, GuardedH11Protocol  # keyless: Host and cross-site checks
from p2pserve.config import ApiConfig, DashboardConfig
from p2pserve.dashboard.app import create_dashboard_app
from p2pserve.dashboard.watch import SwarmWatch
from p2pserve.errors import ConfigError

READY = "P2PSERVE_DASHBOARD_READY"  # printed with url=... once the page is served


class _QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self):
        """Install nothing: :meth:`DashboardServer.close` stops the server."""
        yield


class DashboardServer:
    """Serves ``watch``'s dashboard at ``config.host:config.port`` and refreshes ``watch``."""

    def __init__(self, watch: SwarmWatch, config: DashboardConfig = DashboardConfig()):
        self.watch = watch
        self.config = config
        self.app = create_dashboard_app(watch)
        self.port: Optional[int] = None
        self._server: Optional[_QuietServer] = None
        self._tasks: list[asyncio.Task] = []

    @property
    def url(self) -> str:
        """The page's address (after :meth:`start`)."""
        host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
        return f"http://{host}:{self.port}/"

    async def start(self) -> int:
        """Take a first snapshot, listen, and start refreshing; returns the port."""
        cfg = self.config
        try:
            family = socket.getaddrinfo(cfg.host, cfg.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
            sock = socket.create_server((cfg.host, cfg.port), family=family)
        except OSError as e:
            raise ConfigError(f"the dashboard cannot listen on {cfg.host}:{cfg.port}: {e}") from e
        self.port = sock.getsockname()[1]
        limits = ApiConfig(host=cfg.host, port=self.port)
        self._server = _QuietServer(uvicorn.Config(
            ApiGuard(self.app, limits), http=functools.partial(GuardedH11Protocol, limits=limits), ws="none", lifespan="off",
            log_config=None, access_log=False, server_header=False, limit_concurrency=limits.max_connections + 1,
            timeout_keep_alive=limits.keep_alive_s, h11_max_incomplete_event_size=limits.max_header_bytes))
        await self.watch.refresh()
        serving = asyncio.create_task(self._server.serve(sockets=[sock]))
        self._tasks = [serving, asyncio.create_task(self.watch.run())]
        while not self._server.started:
            if serving.done():
                serving.result()
                raise ConfigError(f"the dashboard on {cfg.host}:{self.port} stopped while starting")
            await asyncio.sleep(0.01)
        return self.port

    async def close(self) -> None:
        """Stop serving and refreshing."""
        if self._server is not None:
            self._server.should_exit = True
        for task in self._tasks[1:]:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []


@contextlib.asynccontextmanager
async def serving(watch: SwarmWatch, config: DashboardConfig):
    """``async with serving(watch, config) as server:`` the dashboard is up (its ready line
    printed: ``P2PSERVE_DASHBOARD_READY url=...``) until the block ends."""
    server = DashboardServer(watch, config)
    await server.start()
    print(f"{READY} url={server.url}", flush=True)
    try:
        yield server
    finally:
        await server.close()
