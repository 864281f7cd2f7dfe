"""Measure this device's throughput table T[j] (Helix's node profile), cached on disk.

A real timed forward on the peer's engine (paged KV in one block pool, batched attention): a
shard of the model's first k layers is loaded and run for a decode batch (``decode_batch``
sessions, one token each, with about ``context`` cached tokens) and for one prefill chunk. Per-step time is affine in the number of layers held (fixed overhead + per-layer
cost), so two measured depths (1 and k) give the whole table: T[j] = tokens / t(j).
The result is cached per (device, model, dtype) so a restart does not re-profile.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import asdict, dataclass

import torch

from p2pserve.model.default import cache_dir
from p2pserve.model.shard import TORCH_DTYPES, Segment, Shard
from p2pserve.model.spec import ModelSpec
from p2pserve.peer.kv_cache import BLOCK_SIZE, KVBudget, PagedCache
from p2pserve.peer.threads import adopt_torch_threads

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Profile:
    """T[j] for j = 1..max_layers, decode and prefill, in tokens/s; and the per-layer latency
    behind them, ``(tokens, ms)`` points per phase (what ``PeerInfo.latency`` announces)."""

    device: str
    model_id: str
    max_layers: int
    decode: list[float]
    prefill: list[float]
    prompt_ms: list[tuple[float, float]] = ()
    decode_ms: list[tuple[float, float]] = ()


def _step_time(shard: Shard, spec: ModelSpec, n_layers: int, batch: int, tokens: int, context: int, reps: int,
               kv_heads: int) -> float:
    """Fastest of ``reps`` steps of ``batch`` sessions over the peer's engine: paged caches in one
    block pool, batched attention as sessions run it (``PagedBatch``). Session i holds
    ``context + i % 8`` tokens, so a batch spans several lengths, as a peer's sessions do."""
    dtype = TORCH_DTYPES[spec.dtype]
    longest = context + 8 + tokens * (reps + 2)
    pool = KVBudget(batch * n_layers * (longest + BLOCK_SIZE))
    _, k_dim, v_dim = spec.kv_layout
    pool.bind(kv_heads, k_dim, dtype, shard.device, v_dim=v_dim)
    caches = [PagedCache(pool, 0, n_layers, longest) for _ in range(batch)]
    warm = [Segment(torch.randint(0, spec.vocab_size, (context + i % 8,)), 0, 0, n_layers, c)
            for i, c in enumerate(caches)]
    shard.forward_batch(warm)
    best = float("inf")
    for r in range(reps):
        segs = [Segment(torch.randint(0, spec.vocab_size, (tokens,)), c.length, 0, n_layers, c) for c in caches]
        if shard.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        shard.forward_batch(segs)
        if shard.device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def measure(model_path: str, spec: ModelSpec, device: str, max_layers: int, decode_batch: int = 32,
            prefill_tokens: int = 128, context: int = 64, reps: int = 3, load=Shard.load, kv_heads: int | None = None,
            ) -> Profile:
    """Time forwards at depth 1 and k and build the decode/prefill tables for 1..max_layers.

    ``load`` builds the timed shard (a tensor-parallel peer passes its group's loader, so the
    whole group's forward is timed; its caches then hold ``kv_heads`` heads, one rank's share).
    """
    k = max(1, min(max_layers, 4, spec.num_layers))
    shard = load(model_path, spec, 0, k, device=device)
    kv_heads = kv_heads or spec.kv_layout[0]
    # Decode: a batch of single tokens. Prefill: one chunk. Segments ending at layer 1 run only
    # the first layer of the k-layer shard. The embedding lookup is included; it is negligible.
    d1 = _step_time(shard, spec, 1, decode_batch, 1, context, reps, kv_heads)
    dk = _step_time(shard, spec, k, decode_batch, 1, context, reps, kv_heads)
    p1 = _step_time(shard, spec, 1, 1, prefill_tokens, context, reps, kv_heads)
    pk = _step_time(shard, spec, k, 1, prefill_tokens, context, reps, kv_heads)
    # one session's decode step: the latency end of the profile (a lone token per layer)
    s1 = _step_time(shard, spec, 1, 1, 1, context, reps, kv_heads)
    sk = _step_time(shard, spec, k, 1, 1, context, reps, kv_heads)

    def per_layer(t1: float, tk: float) -> float:
        return max((tk - t1) / (k - 1), 1e-9) if k > 1 else t1

    def table(t1: float, tk: float, tokens: int) -> list[float]:
        layer = per_layer(t1, tk)
        fixed = max(t1 - layer, 0.0)
        return [tokens / (fixed + j * layer) for j in range(1, max_layers + 1)]

    # Per-layer ms by batch tokens (fixed costs left out, as Helix's profiles): a one-token
    # prompt costs what a lone decode token does, so both phases start at (1, lone).
    lone, batch = 1e3 * per_layer(s1, sk), 1e3 * per_layer(d1, dk)
    prompt = 1e3 * per_layer(p1, pk)
    prompt_ms = [(1.0, lone)] + ([(float(prefill_tokens), max(prompt, lone))] if prefill_tokens > 1 else [])
    decode_ms = [(1.0, lone)] + ([(float(decode_batch), max(batch, lone))] if decode_batch > 1 else [])
    return Profile(device, spec.model_id, max_layers, table(d1, dk, decode_batch), table(p1, pk, prefill_tokens),
                   prompt_ms, decode_ms)


def load_or_measure(model_path: str, spec: ModelSpec, device: str, max_layers: int, decode_batch: int = 32,
                    tp=None, load=None) -> Profile:
    """The cached profile for this device+model, measuring it on first use.

    ``decode_batch`` is the number of concurrent sessions the decode figure assumes: a peer
    batches across sessions, so its capacity is the throughput of a typical batch, not of one
    stream (Helix profiles nodes the same way). ``tp`` (a ``TPGroup``) times the group instead;
    ``load`` replaces ``Shard.load`` (a hub peer times a stand-in of random weights, ``model/stand_in.py``).
    """
    threads = adopt_torch_threads()  # called in a worker thread: time it with the peer's thread count
    # a CPU profile holds for its thread count only (``--num-threads`` changes it 1.7x on SmolLM2)
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else f"cpu-t{threads}"
    extra, label = ({"load": load} if load is not None else {}), device
    if tp is not None:  # announced as the group's device: "cpu x2", "cuda:0 x4"
        label = f"{device} x{tp.config.world}"
        name = f"{name}-tp{tp.config.world}"
        extra = dict(load=tp.load, kv_heads=spec.num_kv_heads // tp.config.world)
    key = f"{name}-{spec.model_id}-{spec.dtype}-{max_layers}-b{decode_batch}-paged-lat".replace("/", "_").replace(" ", "_")
    path = cache_dir() / "profiles" / f"{key}.json"
    if path.is_file():
        try:
            cached = Profile(**json.loads(path.read_text()))
            return dataclasses.replace(cached, device=label, prompt_ms=[tuple(x) for x in cached.prompt_ms],
                                       decode_ms=[tuple(x) for x in cached.decode_ms])
        except (TypeError, ValueError):
            log.warning("ignoring unreadable profile cache %s", path)
    t = time.perf_counter()
    profile = measure(model_path, spec, device, max_layers, decode_batch=decode_batch, **extra)
    log.info("profiled %s in %.1f s: T[1]=%.0f T[%d]=%.0f decode tokens/s", name, time.perf_counter() - t,
             profile.decode[0], max_layers, profile.decode[-1])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(profile)))
    return dataclasses.replace(profile, device=label)
