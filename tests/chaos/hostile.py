"""A hostile participant: a client node of its own that sends real peers what honest clients never
do, through the same transports (the direct TCP path, or libp2p streams alone) and raw frames.

Attacks: a Forward with NaN hidden states, one with out-of-vocabulary token ids, one with a
negative position; a Forward on a session id this stream does not own, and CloseSession of
another stream's session (whose owner must still be served afterwards); a frame claiming a
256 MiB payload (one byte over the default limit, or exactly at it with only a little sent);
garbage frames; a burst of OpenSession on one stream; and idle connections left open, on the
session protocol and on the direct port before attaching.

Every attack records what came back (a typed error code, a result, the stream closing, nothing
at all). What must not happen shows up elsewhere: in the honest clients' tallies and in the
peers' ``GetStats`` (``compute_alive``).
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
from collections import Counter, defaultdict

import torch

from p2pserve.protocol import (
    FRAME_PREFIX,
    PROTOCOL_VERSION,
    SESSION_PROTOCOL,
    CloseSession,
    DirectOffer,
    ErrorReply,
    Forward,
    FrameLimits,
    OpenDirect,
    OpenSession,
    decode_reply,
    encode_frame,
)
from p2pserve.transport import Stream
from p2pserve.transport.frames import read_frame, tensor_to_wire, write_frame

LIMITS = FrameLimits()
HUGE = 256 * 1024 * 1024  # the default max_payload_bytes
ATTACKS = ("nan_hidden", "oov_ids", "negative_position", "foreign_session", "close_others", "huge_claim",
           "garbage", "open_burst", "idle_connection")


class Hostile:
    """Attacks the targets it is given, one attack per call, every kind in turn."""

    def __init__(self, transport, model_id: str, num_layers: int, hidden_size: int, vocab_size: int, seed: int = 1,
                 burst: int = 48, max_idle: int = 12, timeout_s: float = 5.0):
        self.transport = transport  # a DirectTransport; ``.inner`` is its libp2p transport
        self.model_id, self.num_layers = model_id, num_layers
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.rng = random.Random(seed)
        self.burst, self.max_idle, self.timeout_s = burst, max_idle, timeout_s
        self.sent: Counter = Counter()
        self.outcomes: dict[str, Counter] = defaultdict(Counter)
        self.idle: list = []  # streams and sockets left open on purpose
        self._turn = 0

    def summary(self) -> dict:
        return {"sent": dict(self.sent), "total": sum(self.sent.values()),
                "outcomes": {k: dict(v) for k, v in self.outcomes.items()}}

    async def attack(self, targets: list[tuple[str, tuple[str, ...], tuple[int, int]]]) -> None:
        """Send the next attack to one of ``targets`` = [(peer id, maddrs, served range)], picking
        one the attack applies to where that matters (layer 0 for token ids, a span that takes
        hidden states for NaN)."""
        kind = ATTACKS[self._turn % len(ATTACKS)]
        self._turn += 1
        fits = [t for t in targets if _fits(kind, t[2])] or targets
        if not fits:
            return
        self.sent[kind] += 1
        try:
            async with asyncio.timeout(self.timeout_s * 4):
                outcome = await getattr(self, kind)(*self.rng.choice(fits))
        except _Refused as e:  # the peer moved or filled up before the attack proper: say so
            outcome = str(e)
        except Exception as e:  # the peer died or froze under us: that is an outcome too
            outcome = f"{type(e).__name__}"
        self.outcomes[kind][outcome] += 1

    # ----------------------------------------------------------------------------- plumbing

    async def _stream(self, peer_id: str, maddrs, direct: bool | None = None) -> Stream:
        direct = self.rng.random() < 0.5 if direct is None else direct
        t = self.transport if direct else self.transport.inner
        return await t.open_stream(peer_id, maddrs, SESSION_PROTOCOL, self.timeout_s)

    async def _reply(self, stream: Stream) -> str:
        """What the peer answers next: an error code, a reply type, "closed" or "no reply"."""
        try:
            async with asyncio.timeout(self.timeout_s):
                header, _ = await read_frame(stream.reader, LIMITS)
        except asyncio.IncompleteReadError:
            return "closed"
        except TimeoutError:
            return "no reply"
        reply = decode_reply(header)
        return f"error:{reply.code}" if isinstance(reply, ErrorReply) else type(reply).__name__

    async def _ask(self, stream: Stream, msg, payload=b"") -> str:
        await write_frame(stream.writer, msg, payload)
        return await self._reply(stream)

    async def _open(self, stream: Stream, start: int, end: int, sid: str | None = None, max_length: int = 64) -> str:
        sid = sid or secrets.token_hex(8)
        outcome = await self._ask(stream, OpenSession(version=PROTOCOL_VERSION, model_id=self.model_id, session_id=sid,
                                                      start=start, end=end, max_length=max_length))
        if outcome != "SessionOpened":
            raise _Refused(f"open refused: {outcome}")
        return sid

    async def _forward(self, stream: Stream, sid: str, tensor: torch.Tensor, position: int = 0) -> str:
        meta, data = tensor_to_wire(tensor)
        return await self._ask(stream, Forward(session_id=sid, step=0, position=position, tensor=meta), data)

    # ----------------------------------------------------------------------------- attacks

    async def nan_hidden(self, peer_id, maddrs, span) -> str:
        """NaN hidden states into a span that takes hidden states (starts after layer 0)."""
        lo, hi = span
        start = lo if lo > 0 else lo + 1
        if start >= hi:
            return "skipped: range too short"
        s = await self._stream(peer_id, maddrs)
        try:
            sid = await self._open(s, start, hi)
            return await self._forward(s, sid, torch.full((3, self.hidden_size), float("nan")))
        finally:
            s.close()

    async def oov_ids(self, peer_id, maddrs, span) -> str:
        """Token ids outside the vocabulary (and negative) into a span starting at layer 0."""
        if span[0] != 0:
            return "skipped: no layer 0"
        s = await self._stream(peer_id, maddrs)
        try:
            sid = await self._open(s, 0, span[1])
            return await self._forward(s, sid, torch.tensor([1, self.vocab_size + 7, -3], dtype=torch.int64))
        finally:
            s.close()

    async def negative_position(self, peer_id, maddrs, span) -> str:
        """A Forward whose position is -5 (msgspec checks bounds on decode, not on encode)."""
        s = await self._stream(peer_id, maddrs)
        try:
            sid = await self._open(s, *span)
            x = torch.tensor([1, 2], dtype=torch.int64) if span[0] == 0 else torch.zeros(2, self.hidden_size)
            return await self._forward(s, sid, x, position=-5)
        finally:
            s.close()

    async def foreign_session(self, peer_id, maddrs, span) -> str:
        """Forward on another stream's session id, then on an id nobody opened."""
        a, b = await self._stream(peer_id, maddrs), await self._stream(peer_id, maddrs)
        try:
            sid = await self._open(a, *span)
            x = torch.tensor([1, 2], dtype=torch.int64) if span[0] == 0 else torch.zeros(2, self.hidden_size)
            theirs = await self._forward(b, sid, x)
            nobody = await self._forward(b, secrets.token_hex(16), x)
            return f"{theirs} / never opened: {nobody}"
        finally:
            a.close()
            b.close()

    async def close_others(self, peer_id, maddrs, span) -> str:
        """CloseSession of another stream's session; its owner must still be served."""
        a, b = await self._stream(peer_id, maddrs), await self._stream(peer_id, maddrs)
        try:
            sid = await self._open(a, *span)
            closed = await self._ask(b, CloseSession(session_id=sid))
            random_id = await self._ask(b, CloseSession(session_id=secrets.token_hex(16)))
            x = torch.tensor([1, 2], dtype=torch.int64) if span[0] == 0 else torch.zeros(2, self.hidden_size)
            owner = await self._forward(a, sid, x)
            return f"{closed} / random id: {random_id} / owner then: {owner}"
        finally:
            a.close()
            b.close()

    async def huge_claim(self, peer_id, maddrs, span) -> str:
        """A Forward frame claiming 256 MiB (+1, over the default limit; or exactly the limit,
        of which 64 KiB are sent before the stream goes quiet and closes)."""
        over = self.sent["huge_claim"] % 2 == 1
        s = await self._stream(peer_id, maddrs)
        try:
            sid = await self._open(s, *span)
            payload_len = HUGE + 1 if over else HUGE
            header = _encode(Forward(session_id=sid, step=0, position=0,
                                     tensor=_meta("float32", [payload_len // 4 // self.hidden_size, self.hidden_size])))
            s.writer.write(FRAME_PREFIX.pack(len(header), payload_len) + header + (b"" if over else os.urandom(65536)))
            await s.writer.drain()
            return f"{'over' if over else 'at'} the limit: {await self._reply(s)}"
        finally:
            s.close()

    async def garbage(self, peer_id, maddrs, span) -> str:
        """Random bytes: a random prefix (absurd lengths), or a sane prefix before a random header."""
        s = await self._stream(peer_id, maddrs)
        try:
            body = os.urandom(self.rng.randint(1, 300))
            raw = os.urandom(12) + body if self.rng.random() < 0.5 else FRAME_PREFIX.pack(len(body), 0) + body
            s.writer.write(raw)
            await s.writer.drain()
            return await self._reply(s)
        finally:
            s.close()

    async def open_burst(self, peer_id, maddrs, span) -> str:
        """``burst`` OpenSession frames written back to back on one stream, then every reply read;
        the sessions are held a moment and dropped with the stream."""
        s = await self._stream(peer_id, maddrs)
        try:
            for _ in range(self.burst):
                msg = OpenSession(version=PROTOCOL_VERSION, model_id=self.model_id, session_id=secrets.token_hex(8),
                                  start=span[0], end=span[1], max_length=256)
                header = _encode(msg)
                s.writer.write(FRAME_PREFIX.pack(len(header), 0) + header)
            await s.writer.drain()
            replies = Counter([await self._reply(s) for _ in range(self.burst)])
            await asyncio.sleep(1.0)
            return ", ".join(f"{k} x{v}" for k, v in sorted(replies.items()))
        finally:
            s.close()

    async def idle_connection(self, peer_id, maddrs, span) -> str:
        """Leave a session stream (or, every other time, a raw TCP connection to the direct port
        that never attaches) open and silent; the oldest is closed beyond ``max_idle``."""
        if self.sent["idle_connection"] % 2 == 0:
            kind, s = "session stream", await self._stream(peer_id, maddrs)
            self.idle.append(s.writer)
        else:
            probe = await self._stream(peer_id, maddrs, direct=False)
            try:
                offer = decode_reply((await read_frame_after(probe, OpenDirect()))[0])
            finally:
                probe.close()
            if not isinstance(offer, DirectOffer) or not offer.port:
                return "no direct port offered"
            host = maddrs[0].split("/")[2]
            _, writer = await asyncio.open_connection(host, offer.port)
            kind = "direct port, never attached"
            self.idle.append(writer)
        while len(self.idle) > self.max_idle:
            self.idle.pop(0).close()
        return f"left open: {kind}"

    async def close(self) -> None:
        """Close every idle connection still held."""
        for w in self.idle:
            try:
                w.close()
            except Exception:  # a transport already torn down
                pass
        self.idle.clear()


class _Refused(Exception):
    """The OpenSession an attack needs was refused (the peer moved, or is full)."""


def _fits(kind: str, span: tuple[int, int]) -> bool:
    if kind == "oov_ids":
        return span[0] == 0
    if kind == "nan_hidden":
        return span[0] > 0 or span[1] - span[0] >= 2
    return True


async def read_frame_after(stream: Stream, msg) -> tuple[bytes, bytes]:
    """Write ``msg`` and read the frame that answers it."""
    await write_frame(stream.writer, msg)
    return await read_frame(stream.reader, LIMITS)


def _encode(msg) -> bytes:
    """The msgpack header of ``msg``, for frames whose prefix is written by hand."""
    return encode_frame(msg)[1]


def _meta(dtype: str, shape: list[int]):
    from p2pserve.protocol import DTYPE_SIZES, TensorMeta

    n = DTYPE_SIZES[dtype]
    for d in shape:
        n *= d
    return TensorMeta(dtype=dtype, shape=shape, nbytes=n)
