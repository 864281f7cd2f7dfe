"""A peer's session handler reduced to the direct path, for unit tests of the direct TLS path.

It answers ``OpenDirect`` with ``listener.offer(remote)`` (a ``DirectOffer(port=0)``, i.e. "no
direct path", without a listener) and any other request with an ``ErrorReply`` carrying the peer
id the stream is served as, so a test sees which stream carried a frame and for whom.
"""

from __future__ import annotations

import asyncio

from p2pserve.protocol import DirectOffer, ErrorReply, FrameLimits, OpenDirect, decode_request
from p2pserve.transport.frames import read_frame, write_frame


async def answer_direct_session(reader, writer, listener=None, remote: str = "", served=None,
                                name_writer: bool = False) -> None:
    """Serve one stream until it closes; ``served`` (a list) collects the ``remote`` of each stream.
    With ``name_writer``, the error reply names the writer's type instead (which transport carried it)."""
    if served is not None:
        served.append(remote)
    while True:
        try:
            header, _ = await read_frame(reader, FrameLimits())
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        if isinstance(decode_request(header), OpenDirect):
            await write_frame(writer, listener.offer(remote) if listener else DirectOffer(port=0))
        else:
            await write_frame(writer, ErrorReply(code="bad_request",
                                                 message=type(writer).__name__ if name_writer else remote))
