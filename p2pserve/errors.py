"""The p2pserve exception tree.

::

    P2PServeError                      base of everything we raise on purpose
    ├── ConfigError                    bad flags / config files / unknown model
    │   └── UnknownModelError          model name or path that does not exist
    ├── ProtocolError                  bytes that do not decode into a valid message
    │   ├── MalformedFrameError        not MessagePack / wrong field types / missing fields
    │   ├── VersionMismatchError       peer speaks another protocol version
    │   └── PayloadTooLargeError       size limit exceeded (checked before allocation)
    ├── RemoteError                    a typed error reply received from a peer (has .code)
    │   ├── OverloadedError            peer's KV budget / queue is full; try another peer
    │   ├── SessionNotFoundError       unknown, closed or expired session
    │   ├── BadRequestError            wrong shape / dtype / layers outside range / bad params
    │   └── RangeMovedError            peer no longer serves that range (plan changed)
    ├── RoutingError                   no pipeline can be built over the current swarm
    ├── GenerationFailedError          retries exhausted; names the hops that failed
    └── PlanningError                  placement problems
        └── InsufficientMemoryError    swarm too small for the model (says how much is missing)

Every error that crosses the wire is an ``ErrorReply`` (see ``protocol.py``) carrying one of the
``ErrorCode`` values; ``RemoteError.from_reply`` maps it back to the class above.
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """Stable error codes carried in wire error replies."""

    MALFORMED = "malformed"
    VERSION = "version_mismatch"
    TOO_LARGE = "payload_too_large"
    BAD_REQUEST = "bad_request"
    UNKNOWN_SESSION = "unknown_session"
    OVERLOADED = "overloaded"
    UNKNOWN_MODEL = "unknown_model"
    RANGE_MOVED = "range_moved"
    INTERNAL = "internal"


class P2PServeError(Exception):
    """Base class for every error p2pserve raises deliberately."""


class ConfigError(P2PServeError):
    """Invalid configuration or command-line flags."""


class UnknownModelError(ConfigError):
    """The requested model does not exist (no such path / not a supported architecture)."""


class ProtocolError(P2PServeError):
    """Bytes received from the network that are not a valid message."""

    code = ErrorCode.MALFORMED


class MalformedFrameError(ProtocolError):
    """Not MessagePack, or a message whose fields are missing or of the wrong type."""


class VersionMismatchError(ProtocolError):
    """The remote side speaks a different protocol version."""

    code = ErrorCode.VERSION


class PayloadTooLargeError(ProtocolError):
    """A frame or tensor exceeds the configured size limit; rejected before allocation."""

    code = ErrorCode.TOO_LARGE


class RemoteError(P2PServeError):
    """A typed error reply received from a remote peer."""

    code = ErrorCode.INTERNAL

    def __init__(self, message: str, *, code: ErrorCode | None = None, peer: str | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.peer = peer

    def __str__(self) -> str:
        where = f" from {self.peer}" if self.peer else ""
        return f"[{self.code.value}]{where}: {self.message}"

    @staticmethod
    def from_code(code: str, message: str, peer: str | None = None) -> "RemoteError":
        """Rebuild the most specific exception class for a wire error code."""
        try:
            ec = ErrorCode(code)
        except ValueError:
            ec = ErrorCode.INTERNAL
        cls = _CODE_TO_CLASS.get(ec, RemoteError)
        return cls(message, code=ec, peer=peer)


class OverloadedError(RemoteError):
    """The peer cannot take this session now (KV budget or queue full)."""

    code = ErrorCode.OVERLOADED


class SessionNotFoundError(RemoteError):
    """The session is unknown to the peer: never opened, closed, or expired."""

    code = ErrorCode.UNKNOWN_SESSION


class BadRequestError(RemoteError):
    """The request is well-formed but invalid: wrong shape, dtype, layer span or parameters."""

    code = ErrorCode.BAD_REQUEST


class RangeMovedError(RemoteError):
    """The peer no longer serves the requested layers (it moved to a new range)."""

    code = ErrorCode.RANGE_MOVED


_CODE_TO_CLASS = {
    ErrorCode.OVERLOADED: OverloadedError,
    ErrorCode.UNKNOWN_SESSION: SessionNotFoundError,
    ErrorCode.BAD_REQUEST: BadRequestError,
    ErrorCode.RANGE_MOVED: RangeMovedError,
}


class RoutingError(P2PServeError):
    """No pipeline from source to sink can be built over the peers currently usable."""


class GenerationFailedError(P2PServeError):
    """Generation gave up after the retry bound; the message lists every failed hop."""


class PlanningError(P2PServeError):
    """The planner cannot produce a valid placement."""


class InsufficientMemoryError(PlanningError):
    """The swarm's total memory cannot hold every layer at least once."""
