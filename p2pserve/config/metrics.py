"""The ``/metrics`` endpoint of a peer, a coordinator or the API."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from p2pserve.errors import ConfigError


@dataclass(frozen=True)
class MetricsConfig:
    """The ``/metrics`` endpoint of a peer or a coordinator (``--metrics-port``, ``--metrics-host``).

    Serving the numbers changes nothing the role does; a peer's is part of its
    :class:`~p2pserve.config.PeerConfig` so that one config builds its whole runtime.
    """

    port: Optional[int] = None  # None: no endpoint (the default); 0 picks a free port
    host: str = "127.0.0.1"  # loopback unless opened on purpose: the numbers describe this node's load

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ConfigError(f"the metrics port must be in [0, 65535], got {self.port}")
