"""Periodic refresh of a node's own records, and their withdrawal on shutdown.

The announcer does not know what a peer is: it calls ``peer_info()`` / ``link_info()`` (the
peer runtime's current view of itself) every refresh period and stores the result. A failed
store is logged and retried at the next period; records outlive one missed refresh because
their TTL is two periods.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Optional

from p2pserve import clock as clocks
from p2pserve.clock import Clock
from p2pserve.dht.records import LinkInfo, PeerInfo
from p2pserve.dht.view import SwarmView

logger = logging.getLogger(__name__)


def next_due(last: Optional[float], period: float, now: float) -> float:
    """When a record refreshed every ``period`` and last stored at ``last`` is due again."""
    return now if last is None else last + period


class Announcer:
    """Keeps this node's PeerInfo (and, if given, LinkInfo) alive in the DHT.

    ``swarm`` is any :class:`~p2pserve.dht.view.SwarmView`; ``clock``/``sleep`` are injectable
    for tests.
    """

    def __init__(
        self,
        swarm: SwarmView,
        peer_info: Callable[[], PeerInfo],
        link_info: Optional[Callable[[], Optional[LinkInfo]]] = None,
        *,
        peer_period: Optional[float] = None,
        link_period: Optional[float] = None,
        clock: Clock = clocks.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        self.swarm = swarm
        self._peer_info = peer_info
        self._link_info = link_info
        self.peer_period = peer_period if peer_period is not None else swarm.config.peer_refresh
        self.link_period = link_period if link_period is not None else swarm.config.link_refresh
        self._clock = clock
        self._sleep = sleep
        self._last_peer: Optional[float] = None
        self._last_link: Optional[float] = None
        self._wake = asyncio.Event()
        self.failures = 0

    def poke(self) -> None:
        """Announce now rather than at the next period (e.g. the peer changed state)."""
        self._last_peer = None
        self._wake.set()

    def poke_links(self) -> None:
        """Store LinkInfo now (fresh measurements arrived)."""
        self._last_link = None
        self._wake.set()

    async def step(self) -> float:
        """Store whatever is due; returns seconds until the next record is due."""
        now = self._clock()
        if now >= next_due(self._last_peer, self.peer_period, now):
            self._last_peer = now
            try:
                await self.swarm.announce_peer(self._peer_info())
            except Exception as e:  # a refused record or a DHT error: retry next period, never die
                self.failures += 1
                logger.warning(f"PeerInfo refresh failed ({e!r}); retrying in {self.peer_period:.1f}s")
        if self._link_info is not None and now >= next_due(self._last_link, self.link_period, now):
            try:
                info = self._link_info()
            except Exception:
                logger.exception("building LinkInfo failed")
                info = None
            if info is not None:  # nothing measured yet: try again at the next peer refresh
                self._last_link = now
                try:
                    await self.swarm.announce_links(info)
                except Exception as e:  # as above
                    self.failures += 1
                    logger.warning(f"LinkInfo refresh failed ({e!r})")
        now = self._clock()
        due = [next_due(self._last_peer, self.peer_period, now)]
        if self._link_info is not None:
            due.append(next_due(self._last_link, self.link_period, now) if self._last_link else due[0])
        return max(0.0, min(due) - now)

    async def run(self, stop: Optional[asyncio.Event] = None) -> None:
        """Refresh until ``stop`` is set (or the task is cancelled), then withdraw."""
        stop = stop or asyncio.Event()
        try:
            while not stop.is_set():
                delay = await self.step()
                self._wake.clear()
                waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
                sleeper = asyncio.ensure_future(self._sleep(delay))
                await asyncio.wait([sleeper, *waiters], return_when=asyncio.FIRST_COMPLETED)
                for t in (sleeper, *waiters):
                    t.cancel()
        finally:
            await self.shutdown()

    async def shutdown(self) -> None:
        """Withdraw this node's records so the planner drops it at once instead of after a TTL."""
        await asyncio.shield(self.swarm.withdraw_all())
