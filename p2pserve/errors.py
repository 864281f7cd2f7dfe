"""The p2pserve exception tree: every error we raise on purpose, and the wire codes.

::

    P2PServeError                        base of everything we raise on purpose
    ├── ConfigError                      bad flags / config files
    │   └── UnknownModelError            local model name or path that does not exist or is unsupported
    │       └── UnsupportedModelError    a checkpoint of a family (or feature) this version cannot run
    ├── ProtocolError         [malformed] bytes from the network that do not decode into a valid message
    │   ├── MalformedFrameError          not MessagePack / wrong field types / missing fields
    │   ├── VersionMismatchError [version_mismatch]  the other side speaks another protocol version
    │   ├── PayloadTooLargeError [payload_too_large] a size limit exceeded (checked before allocation)
    │   └── RecordRejected               a DHT record that decoded but whose contents are not acceptable
    ├── RequestError          [internal] a request a peer refused: raised by the refusing peer, and
    │   │                                re-raised by the client from the peer's ErrorReply (``peer`` set)
    │   ├── OverloadedError   [overloaded]       KV budget / queue full; try another peer
    │   ├── SessionNotFoundError [unknown_session] unknown, closed or expired session
    │   ├── BadRequestError   [bad_request]      wrong shape / dtype / layers outside range / bad params
    │   ├── RangeMovedError   [range_moved]      the peer no longer serves that range (plan changed)
    │   └── ModelMismatchError [unknown_model]   the peer serves another model
    ├── RoutingError                     no pipeline can be built over the current swarm
    │   └── NoRouteError                 ... because of masks; says which peers and why
    ├── GenerationFailedError            retries exhausted; names the hops that failed
    │   └── AllRoutesOverloadedError     ... and every route was refused as overloaded (HTTP 429)
    ├── HTTPError                        an HTTP API error answered with a status and an OpenAI body
    └── PlanningError                    placement problems
        └── InsufficientMemoryError      swarm too small for the model (says how much is missing)

Direction is not part of the class: a peer raises ``OverloadedError`` for its own refusal, sends it
as an ``ErrorReply`` (``protocol.py``), and the client re-raises the same class from the reply
with :func:`error_from_reply`, which sets ``peer`` to the peer that sent it. :data:`ERROR_CLASSES`
is the one table between wire codes and classes; each class's ``code`` is its inverse.
"""

from __future__ import annotations

from enum import Enum
from typing import Mapping, Optional


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
    """The requested local model does not exist (no such path / not a supported architecture)."""


class UnsupportedModelError(UnknownModelError):
    """A readable checkpoint whose family (``model_type``) or a feature of it this version cannot
    run; ``family`` names the family, and the message says what is supported."""

    def __init__(self, message: str, family: Optional[str] = None):
        super().__init__(message)
        self.family = family


class _WireError(P2PServeError):
    """An error that can cross the wire as an ``ErrorReply``: it has a ``code`` and may name a peer.

    ``peer`` is the peer that sent the error reply, or None where the error was raised locally.
    """

    code = ErrorCode.INTERNAL

    def __init__(self, message: str, *, peer: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.peer = peer

    def __str__(self) -> str:
        where = f" from {self.peer}" if self.peer else ""
        return f"[{self.code.value}]{where}: {self.message}"


class ProtocolError(_WireError):
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


class RecordRejected(ProtocolError):
    """A DHT record decoded fine but its contents are not acceptable; ``reason`` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


class RequestError(_WireError):
    """A request a peer refused (the base class; also an internal failure on the peer)."""


class OverloadedError(RequestError):
    """The peer cannot take this session now (KV budget or queue full)."""

    code = ErrorCode.OVERLOADED


class SessionNotFoundError(RequestError):
    """The session is unknown to the peer: never opened, closed, or expired."""

    code = ErrorCode.UNKNOWN_SESSION


class BadRequestError(RequestError):
    """The request is well-formed but invalid: wrong shape, dtype, layer span or parameters."""

    code = ErrorCode.BAD_REQUEST


class RangeMovedError(RequestError):
    """The peer no longer serves the requested layers (it moved to a new range)."""

    code = ErrorCode.RANGE_MOVED


class ModelMismatchError(RequestError):
    """The peer serves a different model than the session asked for."""

    code = ErrorCode.UNKNOWN_MODEL


#: The one table between wire codes and classes (each class's ``code`` is its inverse).
ERROR_CLASSES: Mapping[ErrorCode, type[_WireError]] = {
    ErrorCode.MALFORMED: MalformedFrameError,
    ErrorCode.VERSION: VersionMismatchError,
    ErrorCode.TOO_LARGE: PayloadTooLargeError,
    ErrorCode.BAD_REQUEST: BadRequestError,
    ErrorCode.UNKNOWN_SESSION: SessionNotFoundError,
    ErrorCode.OVERLOADED: OverloadedError,
    ErrorCode.UNKNOWN_MODEL: ModelMismatchError,
    ErrorCode.RANGE_MOVED: RangeMovedError,
    ErrorCode.INTERNAL: RequestError,
}

#: What a client catches around one hop's reply: every error a peer can answer with.
WIRE_ERRORS = (ProtocolError, RequestError)


#: What a peer answers, whatever went wrong, when it cannot reach a push route's next hop: one
#: message, so that a hostile record cannot make the peer tell a client what its addresses hold.
NEXT_HOP_UNREACHABLE = "next hop unreachable from this peer"


def is_next_hop_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` is a peer's report that it could not reach its next hop (a push or a ring
    between two peers that cannot dial each other, or a next hop that is gone)."""
    return isinstance(exc, _WireError) and exc.code is ErrorCode.INTERNAL and exc.message == NEXT_HOP_UNREACHABLE


def error_from_reply(code: str, message: str, peer: Optional[str] = None) -> _WireError:
    """The exception for an ``ErrorReply`` received from ``peer``; unknown codes become ``RequestError``."""
    try:
        ec = ErrorCode(code)
    except ValueError:
        ec = ErrorCode.INTERNAL
    return ERROR_CLASSES[ec](message, peer=peer)


class SilentRingError(P2PServeError, TimeoutError):
    """A ring's last hop gave the client no answer in time. Every hop of a ring waits on the one
    before it, so the silent hop may be any of them: the client does not blame the last hop, it
    drives the route, whose per-hop calls find the silent one."""


class RoutingError(P2PServeError):
    """No pipeline from source to sink can be built over the peers currently usable."""


class NoRouteError(RoutingError):
    """No pipeline from source to sink avoids the masked peers.

    ``reasons`` maps each masked peer to why; ``overloaded`` is True when a route would exist
    if only the load masks (overloaded answers, KV high-water mark) were lifted.
    """

    def __init__(self, message: str, reasons: Optional[Mapping[str, str]] = None, overloaded: bool = False):
        super().__init__(message)
        self.reasons = dict(reasons or {})
        self.overloaded = overloaded


class GenerationFailedError(P2PServeError):
    """Generation gave up after the retry bound; the message lists every failed hop."""


class AllRoutesOverloadedError(GenerationFailedError):
    """Every route goes through a peer that refused the session as overloaded (HTTP 429)."""


class HTTPError(P2PServeError):
    """An HTTP API error answered with ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        """The JSON error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class PlanningError(P2PServeError):
    """The planner cannot produce a valid placement."""


class InsufficientMemoryError(PlanningError):
    """The swarm's total memory cannot hold every layer at least once."""
