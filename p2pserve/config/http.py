"""The HTTP servers' settings: the OpenAI-compatible API (:class:`ApiConfig`) and the web
dashboard (:class:`DashboardConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from p2pserve.errors import ConfigError


@dataclass(frozen=True)
class ApiConfig:
    """The OpenAI-compatible HTTP server (``p2pserve api``): where it listens, who may use it, and
    the bounds that keep one client from holding its connections, memory or event loop."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()  # names requests may use besides the checkpoint id
    allowed_hosts: tuple[str, ...] = ()  # keyless: Host names served besides IP literals and localhost
    api_key: Optional[str] = field(default=None, repr=False)  # None: open to anyone who can connect
    header_timeout_s: float = 10.0  # from connect (or the last response) to a complete request head
    body_timeout_s: float = 30.0  # from the head to the end of the body (408, then close)
    keep_alive_s: float = 5.0  # an idle kept-alive connection is closed after this
    max_header_bytes: int = 16 * 1024  # request line + headers
    max_body_bytes: int = 4 * 1024**2  # 413, from Content-Length before reading and while reading
    max_inflight_body_bytes: int = 64 * 1024**2  # bodies being read, all together; past it 503
    max_connections: int = 256  # open connections; the next one gets 503 and is closed
    max_generations: int = 64  # generations in flight; the next request gets 429 with Retry-After
    max_prompt_chars: int = 200_000  # characters of prompt (or token ids), checked before tokenising
    shutdown_grace_s: float = 5.0  # running requests get this long to finish on shutdown

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("the API key is empty; give a non-empty key, or none for an open API")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s", "max_header_bytes", "max_body_bytes",
                     "max_inflight_body_bytes", "max_connections", "max_generations", "max_prompt_chars"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"ApiConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_inflight_body_bytes < self.max_body_bytes:
            raise ConfigError("ApiConfig.max_inflight_body_bytes must be >= max_body_bytes (one body must fit)")


@dataclass(frozen=True)
class DashboardConfig:
    """The web dashboard (``p2pserve status --web``, ``coordinator --web-port``, ``api
    --dashboard``; ``docs/dashboard.md``): where it listens and how much it remembers. Its HTTP
    connections are bounded like the API's (``ApiConfig``'s header/body timeouts and connection
    cap, through the same guarded protocol)."""

    host: str = "127.0.0.1"  # the page shows the whole swarm and this process's routes: local by default
    port: int = 8787
    refresh_s: float = 2.0  # one DHT read per refresh, however many browsers poll /api/swarm
    history_samples: int = 300  # tokens/s samples kept (10 minutes at the default refresh)
    history_peers: int = 16  # peers whose observed rate is charted (the fastest)
    recent_requests: int = 50  # requests listed with their routes (api only)
    max_links: int = 4096  # links listed, between live peers

    def __post_init__(self) -> None:
        if not self.refresh_s > 0:
            raise ConfigError(f"DashboardConfig.refresh_s must be > 0, got {self.refresh_s!r}")
        for name in ("history_samples", "history_peers", "recent_requests", "max_links"):
            if getattr(self, name) < 1:
                raise ConfigError(f"DashboardConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"DashboardConfig.port must be in [0, 65535], got {self.port}")
