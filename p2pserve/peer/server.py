"""Composition root of a peer: model shard, compute worker, session table, libp2p handlers.

``Peer.create(config)`` does all I/O (DHT start, weight loading); ``run()`` serves until
``shutdown()``. The DHT node is started before the weights are loaded, so that its process is
forked while the parent is still small and single-threaded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch

from p2pserve.config import PeerConfig
from p2pserve.model.default import resolve_model
from p2pserve.model.shard import TORCH_DTYPES, Shard
from p2pserve.model.spec import ModelSpec, load_spec
from p2pserve.peer.batcher import TokenThrottle
from p2pserve.peer.handlers import SessionHandler
from p2pserve.peer.kv_cache import KVBudget
from p2pserve.peer.sessions import SessionTable
from p2pserve.peer.worker import ComputeWorker
from p2pserve.protocol import SESSION_PROTOCOL

log = logging.getLogger(__name__)


@dataclass
class Peer:
    """A running peer serving layers [start, end) of one model."""

    config: PeerConfig
    spec: ModelSpec
    model_path: str
    start: int
    end: int
    dht: object
    p2p: object
    worker: ComputeWorker
    table: SessionTable
    handler: SessionHandler
    _reaper: asyncio.Task | None = None
    _stopped: asyncio.Event | None = None

    @classmethod
    async def create(cls, config: PeerConfig, dht=None) -> "Peer":
        """Start the DHT node (unless given), load the shard, register the session handler."""
        import hivemind

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        model_path = str(resolve_model(config.model))
        spec = load_spec(model_path, dtype=config.dtype)
        start = 0 if config.start is None else config.start
        end = spec.num_layers if config.end is None else config.end
        if not (0 <= start < end <= spec.num_layers):
            from p2pserve.errors import ConfigError

            raise ConfigError(f"--layers {start}:{end} is not inside [0, {spec.num_layers}) for this model")
        if dht is None:
            dht = hivemind.DHT(
                initial_peers=list(config.initial_peers),
                host_maddrs=list(config.host_maddrs),
                announce_maddrs=list(config.announce_maddrs) or None,
                identity_path=config.identity_path,
                start=True,
            )
        p2p = await dht.replicate_p2p()
        t0 = time.perf_counter()
        shard = Shard.load(model_path, spec, start, end, device=config.device)
        log.info("loaded layers [%d, %d) of %s in %.1f s", start, end, spec.model_id, time.perf_counter() - t0)
        n_layers = end - start
        capacity = config.kv_budget_token_layers
        if capacity is None:
            capacity = config.kv_memory_bytes // spec.kv_bytes_per_token_layer
        budget = KVBudget(capacity)
        table = SessionTable(
            spec=spec,
            served=(start, end),
            budget=budget,
            idle_timeout_s=config.session_idle_timeout_s,
            max_sessions=config.max_sessions,
            torch_dtype=TORCH_DTYPES[spec.dtype],
            device=config.device,
        )
        worker = ComputeWorker(shard, TokenThrottle(config.batching), budget)
        handler = SessionHandler(spec, table, worker, config.frame_limits, config.request_timeout_s)
        peer = cls(config, spec, model_path, start, end, dht, p2p, worker, table, handler)
        worker.start()
        await p2p.add_binary_stream_handler(SESSION_PROTOCOL, handler.handle_stream)
        peer._stopped = asyncio.Event()
        peer._reaper = asyncio.create_task(peer._reap_idle())
        log.info("serving %d layer(s), KV budget %d token-layers", n_layers, capacity)
        return peer

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
            expired = self.table.expire_idle()
            if expired:
                log.info("expired %d idle session(s)", len(expired))

    async def run(self) -> None:
        """Serve until shutdown() is called."""
        await self._stopped.wait()

    async def shutdown(self) -> None:
        """Stop serving, stop the compute thread and the DHT node."""
        if self._reaper:
            self._reaper.cancel()
        try:
            await self.p2p.remove_binary_stream_handler(SESSION_PROTOCOL)
        except Exception:  # daemon may be gone already
            pass
        self.worker.stop()
        self.dht.shutdown()
        self._stopped.set()
