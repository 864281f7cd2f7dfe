"""The OpenAI-compatible HTTP server: the FastAPI app of :mod:`p2pserve.http.openai.app` served
by uvicorn inside the caller's event loop (the loop the ``AsyncClient`` runs on).

It runs in :class:`~p2pserve.http.embedded.EmbeddedServer` (a bound socket, so ``port=0``
reports the port it got; :class:`~p2pserve.http.guard.GuardedH11Protocol` for the head and body
timeouts and the connection cap; no signal handlers). Every bound comes from one
:class:`~p2pserve.config.ApiConfig`.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from p2pserve.config import ApiConfig
from p2pserve.http.embedded import EmbeddedServer, bind, uvicorn_config
from p2pserve.http.openai.app import create_app

log = logging.getLogger(__name__)


class OpenAIServer:
    """Serves the OpenAI API for one started ``AsyncClient`` (see :mod:`p2pserve.http.openai.app`)."""

    def __init__(self, client, config: ApiConfig = ApiConfig(), clock=time.time):
        self.config = config
        self.app = create_app(client, config, clock)
        self.port: Optional[int] = None
        self._server = EmbeddedServer("the HTTP server")

    @property
    def primary_model(self) -> str:
        """The first served model name (the checkpoint id without one)."""
        return self.app.state.api.primary_model

    async def start(self) -> int:
        """Listen on ``config.host:config.port``; returns the port (useful with port 0)."""
        cfg = self.config
        sock = bind(cfg.host, cfg.port)
        self.port = sock.getsockname()[1]
        await self._server.start(cfg.host, sock, uvicorn_config(self.app, cfg))
        if cfg.api_key is None:
            log.warning(f"no API key: anyone who can reach {cfg.host}:{self.port} may use this API "
                        "(give --api-key or P2PSERVE_API_KEY)")
        return self.port

    async def close(self) -> None:
        """Stop listening; running requests get ``shutdown_grace_s`` to finish, then are cancelled,
        and so are their generations (whose swarm sessions are closed before this returns)."""
        await self._server.close()
        await self.app.state.api.aclose()
