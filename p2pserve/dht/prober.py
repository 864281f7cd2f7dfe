"""Link prober: bandwidth and RTT to other peers over hivemind P2P binary streams.

Probes travel libp2p streams through the node's go-libp2p daemon, the transport activations use
whenever the direct TCP path is unavailable (relays included). Where the direct path is used, it
runs between the same addresses over the same network, so a shaped or slow link reads the same
on both (a 20 Mbit/s tbf link: 2.39 MB/s through libp2p, 2.39 MB/s plain TCP); only links fast
enough to make libp2p's encryption CPU-bound read lower here than the direct path would carry.

The ``p2pserve.probe`` protocol runs one stream per probe round, any number of requests on it;
its typed messages are in ``dht/probe_messages.py``.

Bandwidth = n / (time from first payload byte to reply - one RTT, capped at a tenth; see
``bandwidth_from``), the best of ``repeats``
transfers at the final size. The clock stops at the receiver's acknowledgement, so buffers
cannot make a transfer look faster than the link; the only upward errors are a shaper's burst
credit (a few KiB against transfers of >= 100 ms) and the RTT subtracted (the fastest ping).
Downward errors are common and large: on a loaded host the sending or receiving process is
descheduled mid-transfer and the link idles (seen here: 20 Mbit/s links read 0.55-0.95x in
single transfers while plain TCP read 0.96x). So the least disturbed transfer is the estimate
of the link, not the median. Transfers grow (64 KiB,
x4 each time, scaled by how far off the target the last one was) until one lasts at least
``target_transfer_s`` (100 ms) or reaches ``max_probe_bytes``: a 10 Mbit/s link stops at the second
transfer (64 KiB in ~52 ms, then ~190 KiB in ~160 ms), a 10 Gbit/s one at the 64 MiB cap (~54 ms).

Rate limiting, so probing never starves serving: the server accepts at most
``max_concurrent`` bulk transfers and ``server_bytes_per_s`` on average (token bucket), and
answers "busy" otherwise; one remote prober may take only ``per_prober_share`` of that budget;
every read of a probe stream has a deadline (``timeout_s``), so a prober that stalls mid-transfer
frees its slot; the client probes one peer at a time and each peer at most once per
``min_interval_s``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Callable, Iterable, Optional

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from p2pserve.config import ProberConfig
from p2pserve.dht.records import LinkInfo, LinkStat
from p2pserve.dht.probe_messages import (
    PROBE_VERSION,
    REPLIES,
    REQUESTS,
    ProbeBulk,
    ProbePing,
    ProbeReply,
    read_probe_frame,
    write_probe_frame,
)
from p2pserve.errors import MalformedFrameError, ProtocolError
from p2pserve.types import PeerId

logger = logging.getLogger(__name__)

PROTOCOL = "p2pserve.probe"
_CHUNK = 1 << 16


def next_probe_size(n: int, elapsed: float, cfg: ProberConfig, rtt: float = 0.0) -> Optional[int]:
    """Size of the next transfer after ``n`` bytes took ``elapsed`` s, or ``None`` when done.

    Done when the transfer was long enough to trust or already at the cap. Long enough means
    the target duration and at least ``_RTT_MULTIPLE`` RTTs, so that the one RTT inside every
    timed transfer is a small, bounded correction (see :func:`bandwidth_from`). Otherwise grow
    toward ~1.5x that, at least x2 and at most x16 per step.
    """
    target = max(cfg.target_transfer_s, _RTT_MULTIPLE * rtt)
    if elapsed >= target or n >= cfg.max_probe_bytes:
        return None
    factor = 16.0 if elapsed <= 0 else 1.5 * target / elapsed
    factor = min(16.0, max(2.0, factor))
    return min(cfg.max_probe_bytes, int(n * factor))


_RTT_MULTIPLE = 10.0


def bandwidth_from(n: int, elapsed: float, rtt: float) -> float:
    """Bytes/s of an n-byte transfer that took ``elapsed`` s including one request/ack RTT.

    Transfers last at least ``_RTT_MULTIPLE`` RTTs, so the RTT is at most a tenth of them; the
    correction is capped there too. A ping slowed by a busy host then over-reads the link by at
    most 11%, where an uncapped correction read a 20 Mbit/s link as 34 Mbit/s.
    """
    busy = max(elapsed - rtt, elapsed * (1.0 - 1.0 / _RTT_MULTIPLE), 1e-9)
    return n / busy


class TokenBucket:
    """Average-rate limiter (bytes/s with a burst), injected clock."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self._clock = rate, burst, clock
        self._level, self._t = burst, clock()

    def take(self, amount: float) -> bool:
        """Take ``amount`` if available now; returns whether it was."""
        now = self._clock()
        self._level = min(self.burst, self._level + (now - self._t) * self.rate)
        self._t = now
        if amount <= self._level:
            self._level -= amount
            return True
        return False

    def give_back(self, amount: float) -> None:
        """Return ``amount`` taken by a transfer that did not happen after all."""
        self._level = min(self.burst, self._level + amount)


class LinkProber:
    """Serves ``p2pserve.probe`` on a P2P handle and measures links to other peers (the hivemind
    implementation of :class:`~p2pserve.dht.view.LinkProbes`)."""

    def __init__(self, p2p: P2P, config: ProberConfig = ProberConfig(), *, clock: Callable[[], float] = time.perf_counter):
        self.p2p = p2p
        self.config = config
        self._clock = clock
        self._bucket = TokenBucket(config.server_bytes_per_s, config.server_burst_bytes, clock)
        self._per_prober: dict[str, TokenBucket] = {}  # remote peer id -> its share of the budget
        self._active = 0
        self._history: dict[str, list[LinkStat]] = {}  # the last keep_rounds readings per peer
        self._last_probe: dict[str, float] = {}
        self._zeros = bytes(_CHUNK)

    # ----------------------------------------------------------------------------- server

    async def start(self) -> None:
        """Register the probe handler on this node's P2P."""
        await self.p2p.add_binary_stream_handler(PROTOCOL, self._handle)

    async def stop(self) -> None:
        """Unregister the handler."""
        await self.p2p.remove_binary_stream_handler(PROTOCOL)

    def _take(self, prober: str, n: int) -> bool:
        """Take ``n`` bytes from ``prober``'s share and from the whole budget, or neither."""
        cfg = self.config
        bucket = self._per_prober.get(prober)
        if bucket is None:
            if len(self._per_prober) >= 1024:  # forget probers that came and went
                self._per_prober.pop(next(iter(self._per_prober)))
            bucket = self._per_prober[prober] = TokenBucket(
                cfg.server_bytes_per_s * cfg.per_prober_share, cfg.server_burst_bytes * cfg.per_prober_share, self._clock)
        if not bucket.take(n):
            return False
        if self._bucket.take(n):
            return True
        bucket.give_back(n)
        return False

    async def _handle(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        prober = str(getattr(info, "peer_id", ""))
        deadline = self.config.timeout_s
        try:
            while True:
                try:
                    async with asyncio.timeout(deadline):
                        req = await read_probe_frame(reader, REQUESTS)
                except asyncio.IncompleteReadError:
                    return  # client closed the stream: normal end of a probe round
                except MalformedFrameError as e:  # answered, then the stream ends
                    await write_probe_frame(writer, ProbeReply(ok=False, error=str(e)[:200]))
                    return
                if req.v != PROBE_VERSION:
                    await write_probe_frame(writer, ProbeReply(ok=False, error=f"probe version {req.v!r} unsupported"))
                    return
                if isinstance(req, ProbePing):
                    await write_probe_frame(writer, ProbeReply(ok=True))
                    continue
                n = req.n
                if not 0 < n <= self.config.max_probe_bytes:
                    await write_probe_frame(writer, ProbeReply(
                        ok=False, error=f"bulk size {n!r} not in (0, {self.config.max_probe_bytes}]"))
                    return
                if self._active >= self.config.max_concurrent or not self._take(prober, n):
                    await write_probe_frame(writer, ProbeReply(ok=False, error="busy"))
                    continue
                await write_probe_frame(writer, ProbeReply(ok=True, go=True))
                self._active += 1
                try:
                    async with asyncio.timeout(deadline):  # a stalled transfer frees the slot
                        left = n
                        while left > 0:  # read and discard: never hold the payload
                            chunk = await reader.read(min(left, 1 << 20))
                            if not chunk:
                                raise asyncio.IncompleteReadError(b"", left)
                            left -= len(chunk)
                finally:
                    self._active -= 1
                await write_probe_frame(writer, ProbeReply(ok=True, n=n))
        except (ProtocolError, asyncio.IncompleteReadError, ConnectionError, TimeoutError) as e:
            logger.info(f"probe stream ended: {e!r}")
        finally:
            writer.close()

    # ----------------------------------------------------------------------------- client

    async def _ping(self, reader, writer) -> float:
        t0 = self._clock()
        await write_probe_frame(writer, ProbePing(v=PROBE_VERSION))
        reply = await read_probe_frame(reader, REPLIES)
        if not reply.ok:
            raise ProtocolError(f"ping refused: {reply.error}")
        return self._clock() - t0

    async def _bulk(self, reader, writer, n: int) -> Optional[float]:
        """Send n bytes; returns seconds from first payload byte to the ack, None if busy."""
        await write_probe_frame(writer, ProbeBulk(v=PROBE_VERSION, n=n))
        go = await read_probe_frame(reader, REPLIES)
        if not go.ok:
            if go.error == "busy":
                return None
            raise ProtocolError(f"bulk refused: {go.error}")
        t0 = self._clock()
        left = n
        while left > 0:
            k = min(left, _CHUNK)
            writer.write(self._zeros[:k] if k < _CHUNK else self._zeros)
            left -= k
            if left % (16 * _CHUNK) == 0 or left == 0:
                await writer.drain()
        reply = await read_probe_frame(reader, REPLIES)
        if not reply.ok or reply.n != n:
            raise ProtocolError(f"bulk not acknowledged: {reply}")
        return self._clock() - t0

    async def probe(self, peer_id: PeerId, addrs: Iterable[str] = ()) -> Optional[LinkStat]:
        """Measure RTT and bandwidth to one peer; ``None`` if it is busy (try later).

        Raises ``ProtocolError`` / ``ConnectionError`` / ``asyncio.TimeoutError`` when the peer
        cannot be probed at all.
        """
        return await asyncio.wait_for(self._probe(peer_id, list(addrs)), self.config.timeout_s)

    async def _probe(self, peer_id: PeerId, addrs: list[str]) -> Optional[LinkStat]:
        pid = PeerID.from_base58(peer_id)
        if addrs:
            try:  # the daemon may not know the peer's addresses yet
                await self.p2p._client.connect(pid, [Multiaddr(a) for a in addrs])
            except Exception as e:  # noqa: BLE001 - stream_open below reports the real failure
                logger.debug(f"connect to {peer_id} failed: {e!r}")
        _info, reader, writer = await self.p2p.call_binary_stream_handler(pid, PROTOCOL)
        try:
            rtt = min([await self._ping(reader, writer) for _ in range(max(1, self.config.pings))])
            n, elapsed = self.config.min_probe_bytes, 0.0
            while True:
                took = await self._bulk(reader, writer, n)
                if took is None:
                    return None
                elapsed = took
                nxt = next_probe_size(n, elapsed, self.config, rtt)
                if nxt is None:
                    break
                n = nxt
            samples = [bandwidth_from(n, elapsed, rtt)]
            for _ in range(self.config.repeats - 1):
                took = await self._bulk(reader, writer, n)
                if took is not None:
                    samples.append(bandwidth_from(n, took, rtt))
            best = max(samples)
        finally:
            writer.close()
        stat = LinkStat(bandwidth=best, rtt=rtt, measured_at=time.time())
        self.record(peer_id, stat)
        return stat

    def record(self, peer_id: PeerId, stat: LinkStat) -> None:
        """Keep one round's reading of the link to ``peer_id`` (the last ``keep_rounds`` count)."""
        rounds = self._history.setdefault(peer_id, [])
        rounds.append(stat)
        del rounds[: -max(1, self.config.keep_rounds)]

    @property
    def results(self) -> dict[str, LinkStat]:
        """The announced estimate per peer, over its last ``keep_rounds`` readings.

        A round can be slowed by whatever else the host runs but never sped up past the link
        (see the module docstring), so the estimate is the best bandwidth and the lowest RTT of
        the recent rounds; keeping only a few rounds still follows a link that really degrades.
        """
        return {
            pid: LinkStat(bandwidth=max(r.bandwidth for r in rounds), rtt=min(r.rtt for r in rounds),
                          measured_at=rounds[-1].measured_at)
            for pid, rounds in self._history.items()
        }

    def due(self, peer_id: PeerId, now: Optional[float] = None) -> bool:
        """Whether ``peer_id`` has not been probed within ``min_interval_s``."""
        now = time.monotonic() if now is None else now
        last = self._last_probe.get(peer_id)
        return last is None or now - last >= self.config.min_interval_s

    async def probe_many(self, targets: dict[str, list[str]]) -> dict[str, LinkStat]:
        """Probe every due target in turn (one at a time); returns the fresh measurements."""
        fresh = {}
        for peer_id, addrs in targets.items():
            if not self.due(peer_id):
                continue
            self._last_probe[peer_id] = time.monotonic()
            try:
                stat = await self.probe(peer_id, addrs)
            except (ProtocolError, ConnectionError, OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
                logger.warning(f"probe to {peer_id} failed: {e!r}")
                continue
            except Exception as e:  # p2pd control errors have no common base class
                logger.warning(f"probe to {peer_id} failed: {e!r}")
                continue
            if stat is None:
                self._last_probe.pop(peer_id, None)  # busy: retry next round
            else:
                fresh[peer_id] = stat
        return fresh

    def forget(self, keep: Iterable[str]) -> None:
        """Drop results for peers no longer in the swarm."""
        keep = set(keep)
        for d in (self._last_probe, self._history):
            for pid in [p for p in d if p not in keep]:
                del d[pid]

    def link_info(self, model: str, my_peer_id: str) -> Optional[LinkInfo]:
        """A LinkInfo record of the current results (``None`` before the first measurement)."""
        results = self.results
        if not results:
            return None
        links = {p: s for p, s in results.items() if p != my_peer_id and math.isfinite(s.bandwidth)}
        return LinkInfo(model=model, peer_id=my_peer_id, links=links, timestamp=time.time())
