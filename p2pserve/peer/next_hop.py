"""Where a forwarding peer dials a push route's next hop: where that peer announced itself.

A push route names peers by id only (``protocol.PushHop``). The addresses come from this peer's
own view of the swarm: the ``addrs`` of the next peer's PeerInfo, a record the swarm reader
accepts only when it is signed by the key of the peer id it names (``dht/swarm.py``,
``dht/acceptance.py``). So the addresses a peer dials are ones their owner published, the same
ones clients dial and the link prober probes; and the transport then authenticates the peer id
(libp2p's handshake, the direct path's pinned certificate, ``transport/tls.py``).

Whatever goes wrong on the way there (no record, a DHT read that failed, a refused or reset
connection, an EOF, a timeout, a malformed reply) is reported upstream as one error with one
message (:func:`unreachable`): a peer that dials what a record announced must not tell a client
what it found there, or a hostile record would make it a port scanner. The detail is logged here.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from p2pserve.dht.view import SwarmReader
from p2pserve.errors import NEXT_HOP_UNREACHABLE, BadRequestError, ErrorCode
from p2pserve.protocol import ErrorReply, PushHop, error_reply
from p2pserve.types import PeerId, SessionId

#: The one account of any failure to reach a next hop (no detail of what the dial found).
UNREACHABLE = NEXT_HOP_UNREACHABLE


def check_route(route: list[PushHop], self_id: str) -> None:
    """Raise BadRequestError unless ``route`` (the hops after this one) is usable: no peer twice,
    not this peer again, no session id twice. Its length was bounded by the decoder
    (``MAX_PUSH_HOPS``), which also refused any hop carrying addresses."""
    peers = [h.peer_id for h in route]
    if len(set(peers)) != len(peers) or self_id in peers:
        raise BadRequestError("a push route names a peer twice (or this peer again)")
    if len({h.session_id for h in route}) != len(route):
        raise BadRequestError("a push route names a session twice")


def unreachable(peer_id: PeerId, session_id: SessionId, step: int) -> ErrorReply:
    """The reply to whoever pushed ``step`` when ``peer_id`` (the next hop) could not be reached
    or answered nonsense: the same code and message whatever happened, naming ``peer_id``."""
    return error_reply(ErrorCode.INTERNAL, UNREACHABLE, session_id, step, peer_id)


class AnnouncedAddresses:
    """``await addresses(peer_id)``: the addresses ``peer_id`` announced, or () if this peer holds
    no live record of it. Records are read at most every ``refresh_s`` (a miss re-reads sooner,
    at most every ``miss_refresh_s``: a peer that just joined)."""

    def __init__(self, reader: SwarmReader, refresh_s: float = 10.0, miss_refresh_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic):
        self.reader = reader
        self.refresh_s, self.miss_refresh_s, self.clock = refresh_s, miss_refresh_s, clock
        self._addrs: dict[str, tuple[str, ...]] = {}
        self._read_at = float("-inf")
        self._lock = asyncio.Lock()

    async def __call__(self, peer_id: PeerId) -> tuple[str, ...]:
        async with self._lock:  # one DHT read at a time, however many sessions open links
            age = self.clock() - self._read_at
            if age >= self.refresh_s or (peer_id not in self._addrs and age >= self.miss_refresh_s):
                peers = await self.reader.get_peers()
                self._addrs = {pid: tuple(s.record.addrs) for pid, s in peers.items()}
                self._read_at = self.clock()
            return self._addrs.get(peer_id, ())
