"""The link prober's messages (``dht/prober.py``): typed msgspec structs, validated on decode.

Each frame is a u32 big-endian length (at most ``MAX_FRAME`` bytes, checked before the body is
read) and one MessagePack map. A request's ``op`` names its kind; a map of any other shape, a
field of the wrong type or a negative size is a ``MalformedFrameError``.

    ProbePing {"op": "ping", "v": 1}          -> ProbeReply {"ok": true}
    ProbeBulk {"op": "bulk", "v": 1, "n": n}  -> ProbeReply {"ok": true, "go": true}, then the
        prober sends exactly n raw bytes -> ProbeReply {"ok": true, "n": n}; or, before any
        payload is read, ProbeReply {"ok": false, "error": "..."} (too big / busy)
"""

from __future__ import annotations

import asyncio
from typing import Optional, Union

import msgspec

from p2pserve.errors import MalformedFrameError, PayloadTooLargeError
from p2pserve.wire_types import NonNegative

PROBE_VERSION = 1
MAX_FRAME = 1024


class ProbePing(msgspec.Struct, tag_field="op", tag="ping", frozen=True):
    """Ask for an empty reply (the round trip is the link's RTT)."""

    v: int


class ProbeBulk(msgspec.Struct, tag_field="op", tag="bulk", frozen=True):
    """Announce ``n`` raw bytes to follow once the server answers ``go``."""

    v: int
    n: NonNegative


ProbeRequest = Union[ProbePing, ProbeBulk]


class ProbeReply(msgspec.Struct, frozen=True, omit_defaults=True):
    """The server's answer: ``ok``, or why not (``error``); ``go`` lets a bulk transfer start,
    ``n`` acknowledges one in full."""

    ok: bool
    error: Optional[str] = None
    go: bool = False
    n: Optional[NonNegative] = None


_enc = msgspec.msgpack.Encoder()
REQUESTS = msgspec.msgpack.Decoder(ProbeRequest)
REPLIES = msgspec.msgpack.Decoder(ProbeReply)


async def write_probe_frame(writer: asyncio.StreamWriter, msg: Union[ProbePing, ProbeBulk, ProbeReply]) -> None:
    """One length-prefixed message."""
    data = _enc.encode(msg)
    writer.write(len(data).to_bytes(4, "big") + data)
    await writer.drain()


async def read_probe_frame(reader: asyncio.StreamReader, decoder: msgspec.msgpack.Decoder):
    """One length-prefixed message decoded by ``decoder`` (``REQUESTS`` or ``REPLIES``);
    ``ProtocolError`` if it is too large or malformed, ``IncompleteReadError`` at the end."""
    size = int.from_bytes(await reader.readexactly(4), "big")
    if size > MAX_FRAME:  # checked before reading the body
        raise PayloadTooLargeError(f"probe frame of {size} bytes exceeds {MAX_FRAME}")
    try:
        return decoder.decode(await reader.readexactly(size))
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as e:
        # a str that is not UTF-8 is no DecodeError
        raise MalformedFrameError(f"malformed probe frame: {e}") from e
