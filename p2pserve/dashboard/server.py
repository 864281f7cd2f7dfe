"""``DashboardServer``: the dashboard app on uvicorn inside the caller's event loop, next to the
:class:`SwarmWatch` loop that feeds it (``p2pserve status --web``, ``coordinator --web-port``).

It runs in the API's :class:`~p2pserve.http.embedded.EmbeddedServer` (guarded h11 protocol with
the default ``ApiConfig`` bounds: a head within 10 s, 256 connections; a bound socket, so
``port=0`` reports the port it got; no signal handlers: the command owns SIGINT/SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Optional

from p2pserve.http.guard import ApiGuard  # keyless: Host and cross-site checks
from p2pserve.config import ApiConfig, DashboardConfig
from p2pserve.dashboard.app import create_dashboard_app
from p2pserve.dashboard.watch import SwarmWatch
from p2pserve.http.embedded import EmbeddedServer, bind, uvicorn_config

READY = "P2PSERVE_DASHBOARD_READY"  # printed with url=... once the page is served


class DashboardServer:
    """Serves ``watch``'s dashboard at ``config.host:config.port`` and refreshes ``watch``."""

    def __init__(self, watch: SwarmWatch, config: DashboardConfig = DashboardConfig()):
        self.watch = watch
        self.config = config
        self.app = create_dashboard_app(watch)
        self.port: Optional[int] = None
        self._server = EmbeddedServer("the dashboard")
        self._refreshing: Optional[asyncio.Task] = None

    @property
    def url(self) -> str:
        """The page's address (after :meth:`start`)."""
        host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
        return f"http://{host}:{self.port}/"

    async def start(self) -> int:
        """Take a first snapshot, listen, and start refreshing; returns the port."""
        cfg = self.config
        sock = bind(cfg.host, cfg.port, "the dashboard ")
        self.port = sock.getsockname()[1]
        limits = ApiConfig(host=cfg.host, port=self.port)
        await self.watch.refresh()
        await self._server.start(cfg.host, sock, uvicorn_config(ApiGuard(self.app, limits), limits, graceful_shutdown=False))
        self._refreshing = asyncio.create_task(self.watch.run())
        return self.port

    async def close(self) -> None:
        """Stop serving and refreshing."""
        if self._refreshing is not None:
            self._refreshing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refreshing
            self._refreshing = None
        await self._server.close()


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
