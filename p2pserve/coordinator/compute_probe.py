"""The coordinator's own compute probes: a peer's decode rate as the coordinator measures it.

Client reports (``dht/reports.py``) cap claims only once clients use a peer and two addresses
report it. The leading coordinator therefore measures each serving peer itself, and trusts what
it measures (``coordinator/claims.py`` counts its own report as an observation on its own):

* it opens an ordinary session on the peer, over the span the peer serves, as any client would:
  the session protocol, a random session id, an ordinary ``max_length``, through a libp2p node of
  its own whose identity is not the coordinator's (``make_transport``; a fresh one every
  ``rotate_s``), and over the peer's direct path when it offers one. A peer cannot tell a probe
  from a client's session by who opens it, so it cannot serve probes faster than clients;
* it sends one row at position 0, then ``steps`` one-row decode Forwards, with random in-range
  inputs: token ids below ``token_id_bound`` for a span starting at layer 0, else Gaussian hidden
  states ``[1, hidden_size]`` in the dtype the peer announced in ``SessionOpened``;
* it times the decode round trips and the OpenSession round trip (no compute behind it: the
  link's RTT), and turns them into an :class:`~p2pserve.dht.reports.ObservedRate` the way a
  client does (``client/trust/observer.py``): ``wall_rate`` = 1 / median round trip, ``rate`` = 1 /
  (median - RTT), at most ``max_rtt_credit`` x ``wall_rate``;
* the results are published as the coordinator's own signed ``ServiceReports`` record, so that
  ``p2pserve status`` (which trusts the elected leader's report) says why a claim is capped.

Cost, bounded: each peer at most once per ``interval_s``; one peer at a time, ``gap_s`` apart;
``steps`` + 1 one-token Forwards and a session of ``max_length`` 16-64 positions per probe (a
short chat turn's; it holds little of a peer's KV budget for a few round trips).

What it does not see: a peer that inspects its inputs could tell Gaussian hidden states from real
activations (the coordinator holds no weights), and serve them differently. A peer that refuses
or fails probes gets no probe result: it stays unobserved, capped as such (claims.py). The probe
measures one session on the peer's current load, like a client's report.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import statistics
import time
from typing import Awaitable, Callable, Mapping, Optional

import torch

from p2pserve.config import ComputeProbeConfig
from p2pserve.clock import Clock, monotonic, wall
from p2pserve.dht.records import PeerInfo
from p2pserve.dht.reports import MAX_REPORTED_PEERS, MAX_TOKENS_PER_S, ObservedRate, ServiceReports
from p2pserve.dtypes import MODEL_DTYPES
from p2pserve.errors import MalformedFrameError
from p2pserve.protocol import (
    PROTOCOL_VERSION,
    CloseSession,
    Forward,
    ForwardResult,
    FrameLimits,
    OpenSession,
    SamplingParams,
    SessionOpened,
)
from p2pserve.transport import Transport
from p2pserve.transport.frames import TORCH_DTYPES, tensor_to_wire
from p2pserve.transport.session_stream import SessionStream, open_session_stream

logger = logging.getLogger(__name__)



def rate_from(rtt_s: float, round_trips: list[float], max_rtt_credit: float) -> tuple[float, float]:
    """(``rate``, ``wall_rate``) of one session from its decode round trips and the link's RTT."""
    med = statistics.median(round_trips)
    wall_rate = min(1.0 / max(med, 1e-9), MAX_TOKENS_PER_S / max_rtt_credit)  # within the record's bounds
    rate = min(1.0 / max(med - rtt_s, 1e-9), max_rtt_credit * wall_rate)
    return rate, wall_rate


def due(peers: Mapping[str, PeerInfo], last: Mapping[str, float], now: float, interval_s: float) -> list[str]:
    """Serving peers not probed for ``interval_s``, the longest-waiting first."""
    ready = [pid for pid, p in peers.items() if p.serving is not None and p.state != "draining"
             and now - last.get(pid, -float("inf")) >= interval_s]
    return sorted(ready, key=lambda pid: (last.get(pid, -float("inf")), pid))


async def probe_peer(transport: Transport, info: PeerInfo, model_id: str, cfg: ComputeProbeConfig,
                     rng: random.Random, limits: FrameLimits = FrameLimits()) -> ObservedRate:
    """Measure ``info``'s one-session decode rate over the span it serves (see the module docstring)."""
    assert info.serving is not None, "only serving peers are probed (due())"
    start, end = info.serving
    stream = await open_session_stream(transport, info.peer_id, info.addrs, cfg.timeout_s)
    link = SessionStream(info.peer_id, limits, cfg.timeout_s, stream)
    sid = secrets.token_hex(16)
    try:
        t0 = time.perf_counter()
        opened, _ = await link.call(OpenSession(version=PROTOCOL_VERSION, model_id=model_id, session_id=sid, start=start,
                                             end=end, max_length=rng.randint(max(16, cfg.steps + 1), max(64, cfg.steps + 1)),
                                             sampling=SamplingParams()))
        rtt = time.perf_counter() - t0
        if not isinstance(opened, SessionOpened):
            raise MalformedFrameError(f"expected SessionOpened, got {type(opened).__name__}")
        gen = torch.Generator().manual_seed(rng.getrandbits(31))
        times = []
        for pos in range(cfg.steps + 1):
            if start == 0:
                row = torch.randint(0, cfg.token_id_bound, (1,), generator=gen)
            else:
                row = torch.randn(1, opened.hidden_size, generator=gen).to(TORCH_DTYPES[opened.dtype] if opened.dtype in MODEL_DTYPES else torch.float32)
            meta, data = tensor_to_wire(row)
            t0 = time.perf_counter()
            reply, _ = await link.call(Forward(session_id=sid, step=pos, position=pos, tensor=meta), data)
            if not isinstance(reply, ForwardResult):
                raise MalformedFrameError(f"expected ForwardResult, got {type(reply).__name__}")
            if pos > 0:  # the first Forward warms the session up
                times.append(time.perf_counter() - t0)
        try:
            await link.call(CloseSession(session_id=sid))
        except Exception:  # closing is best effort: the measurement stands
            pass
    finally:
        stream.close()
    rate, wall_rate = rate_from(rtt, times, cfg.max_rtt_credit)
    return ObservedRate(peer_id=info.peer_id, layers=end - start, samples=len(times), rate=rate,
                        wall_rate=wall_rate, observed_at=wall())


class ComputeProber:
    """The leader's prober: which peers are due, their latest results, and its report record.

    ``make_transport()`` starts the probing node (an identity other than the coordinator's);
    ``model_id`` is the model name sessions are opened for (the peers' checkpoint id).
    """

    def __init__(self, make_transport: Callable[[], Awaitable[Transport]], model_id: str,
                 config: ComputeProbeConfig = ComputeProbeConfig(), clock: Clock = monotonic,
                 seed: Optional[int] = None):
        self.make_transport = make_transport
        self.model_id = model_id
        self.config = config
        self.clock = clock
        self.rng = random.Random(seed)
        self.results: dict[str, ObservedRate] = {}  # peer id -> latest successful probe
        self.failures: dict[str, str] = {}  # peer id -> why its latest probe failed
        self._last: dict[str, float] = {}  # peer id -> when it was last probed (clock)
        self._transport: Optional[Transport] = None
        self._born = 0.0

    async def round(self, peers: Mapping[str, PeerInfo], stop: asyncio.Event) -> int:
        """Probe every peer due, one at a time; returns how many were probed."""
        done = 0
        for pid in due(peers, self._last, self.clock(), self.config.interval_s):
            if stop.is_set():
                break
            self._last[pid] = self.clock()
            try:
                transport = await self._node()
                model_id = peers[pid].model_id or self.model_id  # a --swarm-model name is not the peers' id
                self.results[pid] = await probe_peer(transport, peers[pid], model_id, self.config, self.rng)
                self.failures.pop(pid, None)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a peer that fails a probe is simply not measured this time
                self.failures[pid] = f"{type(e).__name__}: {e}"
                logger.info(f"compute probe of {pid} failed: {self.failures[pid]}")
            done += 1
            await asyncio.sleep(self.config.gap_s)
        return done

    def report(self, reporter_id: str, model: str, addrs: list[str]) -> ServiceReports:
        """This coordinator's fresh results as its signed-to-be ``ServiceReports`` record."""
        now = wall()
        rates = [r for r in self.results.values() if now - r.observed_at <= self.config.max_age_s]
        rates = sorted(rates, key=lambda r: -r.observed_at)[:MAX_REPORTED_PEERS]
        return ServiceReports(model=model, reporter_id=reporter_id, addrs=addrs, rates=rates, timestamp=now)

    async def node(self) -> Transport:
        """The probing node (an identity other than the coordinator's), started or rotated as due;
        retrials (``coordinator/retrial.py``) open their sessions through it too."""
        return await self._node()

    async def _node(self) -> Transport:
        if self._transport is not None and self.clock() - self._born >= self.config.rotate_s:
            await self.close()
        if self._transport is None:
            self._transport, self._born = await self.make_transport(), self.clock()
        return self._transport

    async def close(self) -> None:
        """Stop the probing node."""
        transport, self._transport = self._transport, None
        if transport is not None:
            await transport.close()
