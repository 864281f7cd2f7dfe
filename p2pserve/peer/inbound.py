"""``InboundStream``: one stream a peer serves, as the session table sees it."""

from __future__ import annotations

from p2pserve.errors import ErrorCode, P2PServeError
from p2pserve.protocol import ErrorReply, error_reply


class InboundStream:
    """One inbound stream: the object sessions are bound to, and who is behind it."""

    __slots__ = ("remote", "opened", "writer", "charged", "over_quota", "batches")

    def __init__(self, remote: str, writer=None):
        self.remote = remote  # the authenticated peer id (``StreamHandler``'s ``remote``)
        self.writer = writer  # a ring's later failure is told up the stream its steps came on (peer/forwarding.py)
        self.opened = False  # whether a session was ever opened on it (it may then idle longer)
        self.charged = remote  # whose stream quota it counts against: a forwarded stream, its session owner's
        self.over_quota = False  # a forwarded stream refused for its owner's quota: it ends after the refusal
        self.batches = 0  # ring batches that came on it and are still running (peer/batch_link.py)


def error_for(exc: P2PServeError, msg) -> ErrorReply:
    """The ErrorReply for ``exc``, naming the session and step of ``msg`` when it has them."""
    code = getattr(exc, "code", ErrorCode.INTERNAL)
    return error_reply(code, getattr(exc, "message", str(exc)), getattr(msg, "session_id", None), getattr(msg, "step", None))


def close_writer(writer) -> None:
    """Close a stream's writer; the transport may already be gone."""
    try:
        writer.close()
    except Exception:
        pass
