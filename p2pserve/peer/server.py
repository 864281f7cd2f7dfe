"""Composition root of a peer: model shard, compute worker, session table, transports.

``Peer.create(config, dht)`` does the I/O (weight loading, handler registration) around
``peer/runtime.py``'s :func:`~p2pserve.peer.runtime.build_runtime`, which wires the parts; ``run()``
serves until ``shutdown()``. The caller starts the DHT node first (``p2pserve peer`` does it via
the control plane's ``Swarm``), so that its process is forked while this one is still small.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from p2pserve.config import PeerConfig
from p2pserve.errors import ConfigError
from p2pserve.metrics import MetricsServer, PeerMetrics, serve_metrics
from p2pserve.model.locate import ModelSource, open_model
from p2pserve.model.joined_shard import joined
from p2pserve.model.shard import Shard
from p2pserve.model.spec import ModelSpec, load_spec
from p2pserve.model.tensor_parallel import local_spec
from p2pserve.peer.handover import hull
from p2pserve.peer.link_dialer import Resolver
from p2pserve.peer.handlers import SessionHandler
from p2pserve.peer.runtime import build_runtime
from p2pserve.peer.sessions import SessionTable
from p2pserve.peer.threads import set_compute_threads
from p2pserve.peer.tp_group import TPGroup
from p2pserve.peer.worker import ComputeWorker
from p2pserve.protocol import SESSION_PROTOCOL
from p2pserve.transport.libp2p import Libp2pTransport
from p2pserve.transport.tcp import DirectAddress, DirectListener, DirectTransport, maddr_hosts

log = logging.getLogger(__name__)


@dataclass
class Peer:
    """A running peer: serves a layer range of one model (or none yet, in plan-driven mode)."""

    config: PeerConfig
    spec: ModelSpec
    model_path: str
    dht: object
    p2p: object
    worker: ComputeWorker
    table: SessionTable
    handler: SessionHandler
    transport: Libp2pTransport
    _reaper: asyncio.Task | None = None
    _watchdog: asyncio.Task | None = None
    _stopped: asyncio.Event | None = None
    metrics_server: MetricsServer | None = None  # the /metrics endpoint, when config.metrics has a port
    tp: TPGroup | None = None  # the tensor-parallel group whose rank 0 this process is (tp_group.py)
    source: ModelSource | None = None  # where the weights come from; a hub id fetches per range

    @classmethod
    async def create(cls, config: PeerConfig, dht, direct_address: DirectAddress = DirectAddress(), *,
                     resolve: Resolver | None = None, reply_key=None,
                     on_group_failure: Callable[[str], None] | None = None,
                     source: ModelSource | None = None) -> "Peer":
        """Load the fixed range (if any) and serve the session protocol on ``dht``'s libp2p node
        (and on the direct path, bound and offered as ``direct_address`` says); with ``config.tp``,
        as rank 0 of a tensor-parallel group whose other ranks it starts first (``on_group_failure``
        is told if the group fails). ``resolve`` finds push-mode next hops (None: this peer pushes
        nowhere); ``reply_key`` signs replies (None: a fresh key); ``config.metrics`` with a port
        serves ``/metrics``. ``source`` is ``config.model`` opened already
        (``model/locate.py``), else it is opened here."""
        set_compute_threads(config.num_threads or torch.get_num_threads())
        source = source or open_model(config.model, "peer")
        model_path = str(source.folder)
        spec = load_spec(model_path, dtype=config.dtype, quant=config.quant)
        p2p = await dht.replicate_p2p()
        tp = config.tp
        group = await asyncio.to_thread(TPGroup.start, tp, model_path, spec, on_group_failure) if tp else None
        peer_id = str(p2p.peer_id)
        transport = Libp2pTransport(p2p)
        direct = None
        if config.direct_port is not None:
            hosts = list(direct_address.listen_hosts) or maddr_hosts([str(m) for m in dht.get_visible_maddrs()])
            if hosts:  # its stream handler is the session handler below, given when it starts
                direct = DirectListener(None, peer_id, hosts, config.direct_port,
                                        announce_port=direct_address.announce_port)
        # the scrape thread reads the peer's state through this closure once the peer exists
        metrics = PeerMetrics(lambda: peer.metric_state()) if config.metrics.port is not None else None
        # push mode: this peer dials the next hop as a client would (libp2p, or the pinned direct path)
        rt = build_runtime(config, spec, peer_id, DirectTransport(transport, config.frame_limits),
                           table_spec=local_spec(spec, tp.world) if tp else None,  # this rank's KV heads
                           resolve=resolve, reply_key=reply_key, direct=direct, metrics=metrics)
        peer = cls(config, spec, model_path, dht, p2p, rt.worker, rt.table, rt.handler, transport, tp=group,
                   source=source)
        fixed = config.start is not None or not config.announce
        if fixed:
            start = 0 if config.start is None else config.start
            end = spec.num_layers if config.end is None else config.end
            if not (0 <= start < end <= spec.num_layers):
                raise ConfigError(f"--layers {start}:{end} is not inside [0, {spec.num_layers}] for this model")
            await peer.load_range(start, end)
        rt.worker.start()
        if direct is not None:
            await direct.start(rt.handler.handle_stream)
        await peer.transport.serve(SESSION_PROTOCOL, rt.handler.handle_stream)
        if metrics is not None:
            peer.metrics_server = serve_metrics(metrics.registry, config.metrics)
        peer._stopped = asyncio.Event()
        peer._reaper = asyncio.create_task(peer._reap_idle())
        peer._watchdog = asyncio.create_task(peer._watch_compute())
        log.info("KV budget %d token-layers", rt.budget.capacity)
        return peer

    def metric_state(self) -> dict[str, float]:
        """The values of ``metrics.PEER_STATE`` now (read by the scrape thread: plain reads only)."""
        budget, worker, served = self.table.budget, self.worker, self.table.served or (0, 0)
        used = budget.used  # read once: used + free = capacity in every scrape
        return {
            "p2pserve_peer_kv_capacity_token_layers": budget.capacity,
            "p2pserve_peer_kv_used_token_layers": used,
            "p2pserve_peer_kv_free_token_layers": budget.capacity - used,
            "p2pserve_peer_queue_jobs": worker.queued_jobs,
            "p2pserve_peer_queue_tokens": worker.queued_tokens,
            "p2pserve_peer_sessions": len(self.table),
            "p2pserve_peer_streams": self.handler.streams_open,
            "p2pserve_peer_served_start_layer": served[0],
            "p2pserve_peer_served_end_layer": served[1],
            "p2pserve_peer_compute_restarts": worker.restarts,
        }

    @property
    def served(self) -> tuple[int, int] | None:
        """The layer range served now, or None."""
        return self.table.served

    async def load_range(self, start: int, end: int) -> None:
        """Load layers [start, end) (reading only their tensors) and flip to them when loaded."""
        self.flip_to(await self.prepare_range(start, end))

    async def prepare_range(self, start: int, end: int) -> Shard:
        """Load layers [start, end) without serving them yet (see :meth:`flip_to`).

        Loading runs in a thread, so the current range keeps serving meanwhile; for a hub id
        the weight files the range reads and the cache lacks are fetched first.
        """
        t0 = time.perf_counter()
        if self.source is not None:
            await asyncio.to_thread(self.source.fetch_layers, self.spec, start, end)
        shard = await asyncio.to_thread(self.load_shard, self.model_path, self.spec, start, end, self.config.device)
        if self.config.compile_buckets and self.tp is None:  # compiled once, before the range serves
            await asyncio.to_thread(shard.enable_compile, self.config.compile_buckets)
        log.info("loaded layers [%d, %d) of %s in %.1f s", start, end, self.spec.model_id, time.perf_counter() - t0)
        return shard

    async def bridge(self, loaded: Shard) -> Shard | None:
        """A shard serving both the current range and ``loaded``'s, built from the modules of the
        two (no load, no copy; ``model/joined_shard.py``), or None where that cannot be: the
        ranges leave a gap, or a tensor-parallel group holds them."""
        current = self.worker.shard
        if current is None or self.tp is not None or hull((current.start, current.end), (loaded.start, loaded.end)) is None:
            return None
        shard = joined(current, loaded)
        if self.config.compile_buckets:
            await asyncio.to_thread(shard.enable_compile, self.config.compile_buckets)
        return shard

    @property
    def load_shard(self):
        """``Shard.load``, or the tensor-parallel group's loader (every rank loads its slices)."""
        return self.tp.load if self.tp is not None else Shard.load

    def flip_to(self, shard: Shard) -> None:
        """Serve ``shard``'s range from now on; sessions whose span is not inside it are closed
        and answer "range moved"."""
        self.worker.replace_shard(shard)
        moved = self.table.retarget((shard.start, shard.end))
        log.info("serving layers [%d, %d) of %s (%d session(s) moved)", shard.start, shard.end,
                 self.spec.model_id, len(moved))

    @property
    def peer_id(self) -> str:
        return str(self.p2p.peer_id)

    def visible_maddrs(self) -> list[str]:
        """Multiaddrs (with /p2p/<id>) that clients and other peers can dial."""
        return [str(m) for m in self.dht.get_visible_maddrs()]

    async def _reap_idle(self) -> None:
        period = max(0.05, min(5.0, self.config.session_idle_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            try:
                expired = self.table.expire_idle()
            except Exception:  # one bad tick must not end the reaper
                log.exception("idle-session reaper tick failed")
                continue
            if expired:
                log.info("expired %d idle session(s)", len(expired))

    @property
    def stuck(self) -> bool:
        """Whether the running compute step has taken longer than ``stuck_step_s`` (the agent
        then announces this peer as draining, so that planners and clients route around it)."""
        return self.worker.stuck_for() > self.config.stuck_step_s

    async def _watch_compute(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                if self.worker.revive():
                    log.error("the compute thread had ended; started a new one (%d so far)", self.worker.restarts)
            except Exception:  # the watchdog itself must not end
                log.exception("compute watchdog tick failed")

    async def run(self) -> None:
        """Serve until shutdown() is called."""
        await self._stopped.wait()

    async def shutdown(self) -> None:
        """Stop serving and stop the compute thread (the DHT node belongs to the caller)."""
        for task in (self._reaper, self._watchdog):
            if task:
                task.cancel()
        try:
            await self.transport.stop_serving(SESSION_PROTOCOL)
        except Exception:  # daemon may be gone already
            pass
        if self.handler.direct is not None:
            await self.handler.direct.stop()
        self.worker.stop()
        if self.tp is not None:
            await asyncio.to_thread(self.tp.stop)
        if self.metrics_server is not None:  # its serving loop polls twice a second: not on this loop
            await asyncio.to_thread(self.metrics_server.close)
        self._stopped.set()
