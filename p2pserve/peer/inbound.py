"""``InboundStream``: one stream a peer serves, as the session table sees it."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from p2pserve.errors import ErrorCode, P2PServeError
from p2pserve.protocol import ErrorReply, FrameLimits, error_reply
from p2pserve.transport.frames import read_frame

# What a stream refused at arrival may send before its refusal: one request frame, no payload.
_FIRST_FRAME_LIMITS = FrameLimits(max_header_bytes=64 * 1024, max_payload_bytes=0)


class InboundStream:
    """One inbound stream: the object sessions are bound to, and who is behind it."""

    __slots__ = ("remote", "opened", "writer", "charged", "over_quota", "batches", "ahead")

    def __init__(self, remote: str, writer=None, ahead=None):
        self.remote = remote  # the authenticated peer id (``StreamHandler``'s ``remote``)
        self.writer = writer  # a ring's later failure is told up the stream its steps came on (peer/forwarding.py)
        self.opened = False  # whether a session was ever opened on it (it may then idle longer)
        self.charged = remote  # whose stream quota it counts against: a forwarded stream, its session owner's
        self.over_quota = False  # a forwarded stream refused for its owner's quota: it ends after the refusal
        self.batches = 0  # ring batches that came on it and are still running (peer/batch_link.py)
        self.ahead = ahead  # its frames read while a request of it waits (peer/read_ahead.py ReadAhead)


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


async def refuse_stream(reader, writer, error: P2PServeError, read_timeout_s: float,
                        reply_error: Callable[[object, P2PServeError], Awaitable[None]]) -> None:
    """Answer a stream refused at arrival (over quota) with ``error`` once its first request is
    in, then close it; ``reply_error`` writes the refusal.

    Why wait for the request, and then for the client to hang up: a reply written and closed
    before the client's request arrived, or closed right after it was written, could be lost
    when the transport reset the stream (the client saw a bare "closed the stream" or a reset
    instead of the typed refusal). Each wait is bounded (``read_timeout_s``, then at most 2 s),
    a first frame carrying a payload is not read beyond its header, and what arrives after the
    reply is discarded as it comes.
    """
    try:
        async with asyncio.timeout(read_timeout_s):
            await read_frame(reader, _FIRST_FRAME_LIMITS)
    except (P2PServeError, ConnectionError, asyncio.IncompleteReadError, TimeoutError):
        pass
    try:
        await reply_error(writer, error)
        async with asyncio.timeout(min(2.0, read_timeout_s)):
            while await reader.read(64 * 1024):
                pass
    except (ConnectionError, TimeoutError):
        pass
    close_writer(writer)
