"""The one place a peer's in-process parts are built from its :class:`~p2pserve.config.PeerConfig`.

:func:`build_runtime` wires the KV budget, the session table, the compute worker, the reply signer,
the push forwarder and the session handler, each given its collaborators when it is built.
``Peer.create`` (the process: libp2p, the direct path, weights), the in-memory push swarm of the
tests and the benchmarks' in-process peer all build their peer with it, so a setting added to
``PeerConfig`` reaches every one of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from p2pserve.config import PeerConfig
from p2pserve.model.shard import TORCH_DTYPES, Shard
from p2pserve.model.spec import ModelSpec
from p2pserve.peer.batcher import TokenThrottle
from p2pserve.peer.forwarding import Forwarder
from p2pserve.peer.link_dialer import LinkDialer, Resolver, dial_concurrency
from p2pserve.peer.handlers import SessionHandler
from p2pserve.peer.kv_cache import KVBudget
from p2pserve.peer.reply_signer import ReplySigner
from p2pserve.peer.sessions import SessionTable
from p2pserve.peer.worker import ComputeWorker
from p2pserve.transport import Transport


@dataclass
class PeerRuntime:
    """A peer's wired parts: sessions, compute, and the handler that serves the session protocol."""

    budget: KVBudget
    table: SessionTable
    worker: ComputeWorker
    forwarder: Forwarder
    handler: SessionHandler


def kv_capacity(config: PeerConfig, spec: ModelSpec) -> int:
    """KV slots in token-layers: the configured count, else what ``kv_memory_bytes`` holds."""
    if config.kv_budget_token_layers is not None:
        return config.kv_budget_token_layers
    return config.kv_memory_bytes // spec.kv_bytes_per_token_layer


def build_runtime(config: PeerConfig, spec: ModelSpec, peer_id: str, transport: Transport, *,
                  shard: Optional[Shard] = None, served: Optional[tuple[int, int]] = None,
                  table_spec: Optional[ModelSpec] = None, resolve: Optional[Resolver] = None,
                  reply_key=None, direct=None, metrics=None) -> PeerRuntime:
    """A peer's runtime from ``config``: ``spec`` is the model's, ``table_spec`` the one its KV
    caches follow (a tensor-parallel rank holds only its share of the KV heads; default ``spec``);
    ``shard`` (serving ``served``) is the range loaded at start, if any.

    ``transport`` dials next hops in push mode, at the addresses ``resolve`` gives (None: this peer
    pushes nowhere); replies are signed as ``peer_id`` with ``reply_key`` (None: a fresh key);
    ``direct`` (a ``DirectListener``, not started) offers the direct path and ``metrics`` (a
    ``PeerMetrics``) counts steps and error replies, each when given.
    """
    budget = KVBudget(kv_capacity(config, spec))
    table = SessionTable(
        spec=table_spec or spec,
        served=served,
        budget=budget,
        idle_timeout_s=config.session_idle_timeout_s,
        max_sessions=config.max_sessions,
        torch_dtype=TORCH_DTYPES[spec.dtype],
        device=config.device,
        admission=config.admission,
    )
    worker = ComputeWorker(shard, TokenThrottle(config.batching), budget, metrics=metrics)
    # next hops are taken to bound streams per peer id as this peer does
    dialer = LinkDialer(transport, dial_concurrency(config.admission.max_streams_per_owner),
                        config.forwarding.connect_timeout_s)
    forwarder = Forwarder(table, transport, peer_id, config.frame_limits, config.forwarding, resolve,
                          loop_ended=worker.loop_ended, dialer=dialer, hold_step=worker.hold_next_step)
    handler = SessionHandler(spec, table, worker, config.frame_limits, config.request_timeout_s, config.admission,
                             signer=ReplySigner(peer_id, spec.model_id, reply_key, dtype=spec.dtype), forwarder=forwarder,
                             direct=direct, metrics=metrics)
    return PeerRuntime(budget, table, worker, forwarder, handler)
