"""How a forwarding peer dials its next hops without crowding its own stream allowance there.

A next hop counts a new stream against the peer id that dialled it until the stream's first
frame names the session it pushes into; from then on it counts against the client that opened
that session (``StreamQuota.charge``). While this peer dials, then, each dial (its libp2p
stream, and during the direct path's upgrade the TLS connection too) is this peer's own at the
next hop. One client pushing many sessions through this peer at once could make it hold, for a
moment, as many such streams as the next hop lets one peer id keep open, and an honest client's
dial in that moment was refused ("you already have N streams open"), with the next hop blamed.
So:

* at most ``concurrency`` dials to one next hop are under way at once (each is at most two
  streams there): this peer's own count at the next hop stays far below the allowance, which
  is taken to be the one this peer grants (``AdmissionConfig.max_streams_per_owner``);
* a dial the next hop refuses for this peer's stream count, a passing state for a peer that
  holds nothing there of its own, is tried again after a short, growing pause, until
  ``timeout_s`` from the first try.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Optional

from p2pserve.errors import OverloadedError
from p2pserve.transport import Stream, Transport
from p2pserve.transport.session_stream import open_session_stream
from p2pserve.types import PeerId

log = logging.getLogger(__name__)

#: Where this peer may dial a peer id: the addresses it announced itself (``peer/next_hop.py``).
Resolver = Callable[[str], Awaitable[Sequence[str]]]


async def announced(resolve: Optional[Resolver], peer_id: PeerId) -> bool:
    """Whether ``resolve`` (this peer's view of the swarm; None: it knows no one) holds addresses
    ``peer_id`` announced; a DHT read that failed counts as none."""
    if resolve is None:
        return False
    try:
        return bool(await resolve(peer_id))
    except Exception as e:
        log.info("could not read the record of %s: %r", peer_id, e)
        return False


#: the first pause after a refused dial (seconds); it doubles per refusal, up to ``MAX_PAUSE_S``
FIRST_PAUSE_S = 0.05
MAX_PAUSE_S = 1.0


def dial_concurrency(max_streams_per_owner: int) -> int:
    """Dials to one next hop under way at once, for a next hop allowing ``max_streams_per_owner``
    streams per peer id: each dial holds at most two there, so a quarter leaves half free."""
    return max(1, max_streams_per_owner // 4)


class LinkDialer:
    """Opens session streams to next hops: ``await dial(peer_id, maddrs)``."""

    def __init__(self, transport: Transport, concurrency: int, timeout_s: float):
        self.transport = transport
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self._gates: dict[PeerId, asyncio.Semaphore] = {}
        self._users: Counter[PeerId] = Counter()  # dials waiting or under way per next hop (to forget idle gates)

    async def dial(self, peer_id: PeerId, maddrs: Sequence[str]) -> Stream:
        """A new session stream to ``peer_id`` at ``maddrs``; the transport's error (the last
        OverloadedError when every try was refused) when it cannot be had within ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        pause = FIRST_PAUSE_S
        while True:
            try:
                return await self._try(peer_id, maddrs, max(0.001, deadline - loop.time()))
            except OverloadedError:
                if loop.time() + pause >= deadline:
                    raise
            await asyncio.sleep(pause * random.uniform(0.5, 1.5))  # spread out: others wait for the same room
            pause = min(2 * pause, MAX_PAUSE_S)

    async def dial_announced(self, peer_id: PeerId, resolve: Optional[Resolver]) -> Stream:
        """A new session stream to ``peer_id`` at the addresses ``resolve`` says it announced;
        ConnectionError (it is unreachable from here) when there are none, the lookup failed, or
        dialling failed otherwise than by a TimeoutError."""
        try:
            found = [] if resolve is None else list(await resolve(peer_id))
        except Exception as e:  # the DHT read failed: we cannot reach it either
            raise ConnectionError(f"looking up {peer_id}: {type(e).__name__}: {e}") from e
        if not found:
            raise ConnectionError(f"{peer_id} is not announced in this peer's view of the swarm; nothing dialled")
        try:
            return await self.dial(peer_id, found)
        except Exception as e:  # whatever dialling raised (the libp2p daemon's ControlFailure): unreachable
            raise e if isinstance(e, (ConnectionError, TimeoutError)) else ConnectionError(f"{type(e).__name__}: {e}")

    async def _try(self, peer_id: PeerId, maddrs: Sequence[str], timeout_s: float) -> Stream:
        """One dial, once fewer than ``concurrency`` others to ``peer_id`` are under way."""
        gate = self._gates.setdefault(peer_id, asyncio.Semaphore(self.concurrency))
        self._users[peer_id] += 1
        try:
            async with asyncio.timeout(timeout_s):
                async with gate:
                    return await open_session_stream(self.transport, peer_id, maddrs, timeout_s)
        finally:
            self._users[peer_id] -= 1
            if self._users[peer_id] <= 0:
                del self._users[peer_id]
                self._gates.pop(peer_id, None)
