"""``SessionStream``: the requester's end of one session-protocol stream to one peer.

Every side that talks to a peer's session handler uses it: the client's hop connections, the
coordinator's compute probe, and a forwarding peer's link to the next hop. It opens the stream
(dialling the peer's addresses), writes one typed request frame, reads one typed reply frame
under the frame limits, and closes. :meth:`call` is a round trip under ``timeout_s`` in which a
typed ``ErrorReply`` is raised as the matching class of ``errors.ERROR_CLASSES``, naming the
peer; :meth:`send` and :meth:`read` are its halves, for callers that pipeline frames and match
replies themselves. It knows frames and the session protocol, nothing of who is asking.
"""

from __future__ import annotations

import asyncio
from typing import Optional, Sequence

from p2pserve.errors import error_from_reply
from p2pserve.protocol import SESSION_PROTOCOL, ErrorReply, FrameLimits, decode_reply
from p2pserve.transport import Stream, Transport
from p2pserve.transport.frames import read_frame, write_frame
from p2pserve.types import PeerId


async def open_session_stream(transport: Transport, peer_id: PeerId, maddrs: Sequence[str],
                              connect_timeout_s: float) -> Stream:
    """A new session-protocol stream to ``peer_id`` (its ``maddrs`` dialled first), within
    ``connect_timeout_s``."""
    return await transport.open_stream(peer_id, tuple(maddrs), SESSION_PROTOCOL, connect_timeout_s)


class SessionStream:
    """Typed request/reply frames on one stream to ``peer_id`` (named ``label`` in errors).

    ``stream`` is None until opened (:meth:`attach`) and after :meth:`close`.
    """

    def __init__(self, peer_id: PeerId, limits: FrameLimits, timeout_s: float, stream: Optional[Stream] = None,
                 label: Optional[str] = None):
        self.peer_id = peer_id
        self.limits = limits
        self.timeout_s = timeout_s
        self.stream = stream
        self.label = label or peer_id

    def attach(self, stream: Stream) -> None:
        """Carry the frames on ``stream`` (one just opened by :func:`open_session_stream`)."""
        self.stream = stream

    def _open_stream(self) -> Stream:
        if self.stream is None:
            raise ConnectionError(f"stream to {self.label} is closed")
        return self.stream

    async def call(self, msg, payload: bytes | memoryview = b"") -> tuple[object, bytes]:
        """Send ``msg`` (with ``payload``) and return the reply and its payload bytes, within
        ``timeout_s``; an ``ErrorReply`` is raised as its typed error."""
        stream = self._open_stream()
        try:
            async with asyncio.timeout(self.timeout_s):  # no extra task per call, unlike wait_for
                await write_frame(stream.writer, msg, payload)
                header, body = await read_frame(stream.reader, self.limits)
        except asyncio.IncompleteReadError:
            raise ConnectionError(f"peer {self.label} closed the stream") from None
        reply = decode_reply(header)
        if isinstance(reply, ErrorReply):
            raise error_from_reply(reply.code, reply.message, peer=self.peer_id)
        return reply, body

    async def send(self, msg, payload: bytes | memoryview = b"") -> None:
        """Write one request frame (no timeout: a caller that needs one wraps it)."""
        await write_frame(self._open_stream().writer, msg, payload)

    async def read(self) -> tuple[object, bytes]:
        """Read one reply frame, decoded (an ``ErrorReply`` is returned, not raised)."""
        header, body = await read_frame(self._open_stream().reader, self.limits)
        return decode_reply(header), body

    def close_stream(self) -> None:
        """Close the stream at once (no goodbye frame)."""
        if self.stream is not None:
            self.stream.close()
            self.stream = None
