"""What one participant may hold on a peer: streams, payload bytes in flight, sessions and KV.

A volunteer peer is open to anyone, so every resource a remote node can make it hold has a
bound, and the bounds that one node could exhaust alone are per owner. An owner is the
authenticated peer id behind a stream (``StreamHandler``'s ``remote``): libp2p authenticates it,
and the direct path inherits it from the libp2p stream that was given its token.

Pure bookkeeping (:class:`StreamQuota`, :func:`check_session_quota`, :func:`payload_allowance`)
plus one small asyncio primitive (:class:`PayloadBudget`); the handlers apply them.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from p2pserve.config import AdmissionConfig
from p2pserve.errors import OverloadedError, PayloadTooLargeError
from p2pserve.protocol import DTYPE_SIZES


class StreamQuota:
    """Open session streams, all owners together and per owner."""

    def __init__(self, bounds: AdmissionConfig):
        self.bounds = bounds
        self.by_owner: Counter[str] = Counter()
        self.total = 0

    def enter(self, owner: str) -> None:
        """Count a new stream of ``owner``; OverloadedError (and nothing counted) when over a bound."""
        if self.total >= self.bounds.max_streams:
            raise OverloadedError(f"this peer already serves {self.bounds.max_streams} streams")
        if self.by_owner[owner] >= self.bounds.max_streams_per_owner:
            raise OverloadedError(
                f"you already have {self.bounds.max_streams_per_owner} streams open to this peer; reuse or close some"
            )
        self.by_owner[owner] += 1
        self.total += 1

    def charge(self, stream, owner_stream) -> None:
        """Count ``stream`` (an ``InboundStream`` counted so far against ``stream.charged``)
        against the client behind ``owner_stream`` (the stream that opened the session ``stream``
        drives; nothing to do when it is ``stream`` itself): a forwarded stream, pushing into a
        session that client opened, is that client's, not the forwarding peer's (else one client
        could use up a peer's allowance at its next hops, and honest clients' pushes through it
        would then fail). OverloadedError (nothing moved, and ``stream.over_quota`` set: the
        handler ends it after the refusal, so the forwarding peer's allowance is not held by it)
        when that client is at its bound."""
        owner = owner_stream.remote
        if owner_stream is stream or stream.charged == owner:
            return
        if self.by_owner[owner] >= self.bounds.max_streams_per_owner:
            stream.over_quota = True
            raise OverloadedError(
                f"the client that opened this session already has {self.bounds.max_streams_per_owner} "
                f"streams open to this peer, its forwarded ones included"
            )
        self.by_owner[owner] += 1
        self.total += 1
        self.leave(stream.charged)
        stream.charged = owner

    def leave(self, owner: str) -> None:
        """Uncount a stream that ended."""
        self.total -= 1
        self.by_owner[owner] -= 1
        if self.by_owner[owner] <= 0:
            del self.by_owner[owner]


def check_session_quota(bounds: AdmissionConfig, capacity: int, held_sessions: int, held_kv: int, need: int) -> None:
    """Raise OverloadedError if an owner holding ``held_sessions`` sessions and ``held_kv``
    token-layers of the peer's ``capacity`` may not reserve ``need`` more."""
    if held_sessions >= bounds.max_sessions_per_owner:
        raise OverloadedError(f"you already hold {bounds.max_sessions_per_owner} sessions on this peer")
    check_kv_share(bounds, capacity, held_kv, need)


def check_kv_share(bounds: AdmissionConfig, capacity: int, held_kv: int, need: int) -> None:
    """Raise OverloadedError if an owner holding ``held_kv`` token-layers of the peer's KV
    ``capacity`` may not take ``need`` more (its sessions grow block by block)."""
    share = int(bounds.max_kv_fraction_per_owner * capacity)
    if bounds.max_kv_fraction_per_owner < 1 and held_kv + need > share:
        raise OverloadedError(
            f"your sessions would hold {held_kv + need} of this peer's {capacity} KV token-layers; "
            f"one client may hold {share}"
        )


def payload_allowance(tokens_left: int, first_layer: bool, hidden_size: int, dtype: str) -> int:
    """The largest payload a Forward may legally carry: ``tokens_left`` more tokens, as token ids
    int64 [n] for a span starting at layer 0, else hidden states [n, hidden_size] of ``dtype``."""
    per_token = DTYPE_SIZES["int64"] if first_layer else hidden_size * DTYPE_SIZES[dtype]
    return max(0, tokens_left) * per_token


class PayloadBudget:
    """Bytes of frame payloads being read or served, all streams together.

    A frame's payload is admitted only once its bytes fit; a frame that could never fit is
    refused at once. Each stream carries one frame at a time, so a stream never waits on itself.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.used = 0
        self._freed = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        """Wait until ``n`` more bytes fit (the caller bounds the wait with a timeout)."""
        if n > self.max_bytes:
            raise PayloadTooLargeError(f"a payload of {n} bytes exceeds this peer's in-flight budget")
        async with self._freed:
            await self._freed.wait_for(lambda: self.used + n <= self.max_bytes)
            self.used += n

    async def release(self, n: int) -> None:
        """Return ``n`` bytes and wake whoever waits for room."""
        async with self._freed:
            self.used -= n
            self._freed.notify_all()
