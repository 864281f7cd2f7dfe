"""Composition root of a peer: model shard, compute worker, session table, transports.

``Peer.create(config, dht)`` does the I/O (weight loading, handler registration); ``run()``
serves until ``shutdown()``. The caller starts the DHT node first (``p2pserve peer`` does it via
the control plane's ``Swarm``), so that its process is forked while this one is still small.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch

from p2pserve.config import PeerConfig
from p2pserve.errors import ConfigError
from p2pserve.metrics import MetricsConfig, MetricsServer, PeerMetrics, serve_metrics
from p2pserve.model.default import resolve_model
from p2pserve.model.shard import TORCH_DTYPES, Shard
from p2pserve.model.spec import ModelSpec, load_spec
from p2pserve.peer.batcher import TokenThrottle
from p2pserve.peer.forwarding import Forwarder
from p2pserve.peer.handlers import SessionHandler
from p2pserve.peer.kv_cache import KVBudget
from p2pserve.model.tensor_parallel import local_spec
from p2pserve.peer.sessions import SessionTable
from p2pserve.peer.tp_group import TPConfig, TPGroup
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
    metrics_server: MetricsServer | None = None  # the /metrics endpoint, once export_metrics ran
    tp: TPGroup | None = None  # the tensor-parallel group whose rank 0 this process is (tp_group.py)

    @classmethod
    async def create(cls, config: PeerConfig, dht, direct_address: DirectAddress = DirectAddress(),
                     tp: TPConfig | None = None) -> "Peer":
        """Load the fixed range (if any) and serve the session protocol on ``dht``'s libp2p node
        (and on the direct path, bound and offered as ``direct_address`` says); with ``tp``, as
        rank 0 of a tensor-parallel group whose other ranks it starts first."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        model_path = str(resolve_model(config.model))
        spec = load_spec(model_path, dtype=config.dtype, quant=config.quant)
        p2p = await dht.replicate_p2p()
        capacity = config.kv_budget_token_layers
        if capacity is None:
            capacity = config.kv_memory_bytes // spec.kv_bytes_per_token_layer
        budget = KVBudget(capacity)
        group = await asyncio.to_thread(TPGroup.start, tp, model_path, spec) if tp else None
        table = SessionTable(
            spec=local_spec(spec, tp.world) if tp else spec,  # caches hold this rank's KV heads
            served=None,
            budget=budget,
            idle_timeout_s=config.session_idle_timeout_s,
            max_sessions=config.max_sessions,
            torch_dtype=TORCH_DTYPES[spec.dtype],
            device=config.device,
            admission=config.admission,
        )
        worker = ComputeWorker(None, TokenThrottle(config.batching), budget)
        handler = SessionHandler(spec, table, worker, config.frame_limits, config.request_timeout_s, config.admission)
        handler.signer.peer_id = str(p2p.peer_id)  # replies name the peer that signed them
        peer = cls(config, spec, model_path, dht, p2p, worker, table, handler, Libp2pTransport(p2p), tp=group)
        # push mode: this peer dials the next hop as a client would (libp2p, or the pinned direct path)
        handler.forwarder = Forwarder(table, DirectTransport(peer.transport, config.frame_limits), peer.peer_id,
                                      config.frame_limits)
        fixed = config.start is not None or not config.announce
        if fixed:
            start = 0 if config.start is None else config.start
            end = spec.num_layers if config.end is None else config.end
            if not (0 <= start < end <= spec.num_layers):
                raise ConfigError(f"--layers {start}:{end} is not inside [0, {spec.num_layers}] for this model")
            await peer.load_range(start, end)
        worker.start()
        if config.direct_port is not None:
            hosts = list(direct_address.listen_hosts) or maddr_hosts([str(m) for m in dht.get_visible_maddrs()])
            if hosts:
                handler.direct = DirectListener(handler.handle_stream, str(p2p.peer_id), hosts, config.direct_port,
                                                announce_port=direct_address.announce_port)
                await handler.direct.start()
        await peer.transport.serve(SESSION_PROTOCOL, handler.handle_stream)
        peer._stopped = asyncio.Event()
        peer._reaper = asyncio.create_task(peer._reap_idle())
        peer._watchdog = asyncio.create_task(peer._watch_compute())
        log.info("KV budget %d token-layers", capacity)
        return peer

    def export_metrics(self, config: MetricsConfig) -> MetricsServer:
        """Count compute steps and error replies from now on, and serve them with the state
        gauges at ``config``'s address (``p2pserve peer --metrics-port``); without this call the
        peer keeps no metrics at all."""
        metrics = PeerMetrics(self.metric_state)
        self.metrics_server = serve_metrics(metrics.registry, config)
        self.worker.metrics = self.handler.metrics = metrics
        return self.metrics_server

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

        Loading runs in a thread, so the current range keeps serving meanwhile.
        """
        t0 = time.perf_counter()
        shard = await asyncio.to_thread(self.load_shard, self.model_path, self.spec, start, end, self.config.device)
        if self.config.compile_buckets and self.tp is None:  # compiled once, before the range serves
            await asyncio.to_thread(shard.enable_compile, self.config.compile_buckets)
        log.info("loaded layers [%d, %d) of %s in %.1f s", start, end, self.spec.model_id, time.perf_counter() - t0)
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
