"""Run one simulation: a scenario, a scheduler, a workload, a measurement window."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from p2pserve.errors import ConfigError
from p2pserve.sim.batching import CapsPolicy, ThrottlePolicy
from p2pserve.sim.cluster import ClusterSim
from p2pserve.sim.engine import EventLoop
from p2pserve.sim.kv import KvEstimator, KvSettings
from p2pserve.sim.metrics import SimResult
from p2pserve.sim.request import Query
from p2pserve.sim.scenario import Scenario
from p2pserve.sim.schedulers import make_scheduler
from p2pserve.sim.transport import TransportConfig, client_graph
from p2pserve.sim.workload import (
    LengthSampler,
    OfflineFeeding,
    load_arrival_counts,
    load_lengths,
    online_arrival_times,
)

#: Offline warm-up and window (Helix: 1 min + 10 min); online window (30 s + 30 min).
OFFLINE_WARMUP_S = 60.0
ONLINE_WARMUP_S = 30.0


@dataclass
class SimConfig:
    """How to drive a scenario."""

    scheduler: str = "iwrr"
    mode: str = "offline"  # offline | online
    duration: float = 600.0  # measurement window, seconds
    warmup: float | None = None  # default by mode
    seed: int = 0
    token_rate: float | None = None  # online: offered prompt+output tokens/s (required)
    throttle: bool | str = False  # gLLM token throttling: False/"off", True/"on", "prefill", "chunked" (on + chunked prefill)
    kv: KvSettings | None = None  # default by mode (Helix's values)
    feeding: OfflineFeeding = field(default_factory=OfflineFeeding)
    lengths: str = "azure_conv"
    arrivals: str = "azure_conv"  # online arrival pattern: a trace's counts, or "poisson" (constant rate)
    drain: float = 0.0  # online: seconds run past the window with no new arrivals (latency SLOs)
    entry_overhead: bool = True
    kv_mask: bool | None = None  # Helix's KV-estimate mask; default: on for iwrr only
    kv_model: str = "reserve"  # node KV: "reserve" (whole footprint) or "vllm" (preemption)
    transport: TransportConfig = field(default_factory=TransportConfig)  # client place, mode, speculation

    def resolved_kv_mask(self) -> bool:
        """KV masking is part of Helix's scheduler (§5.2); the baselines route without it."""
        return self.scheduler == "iwrr" if self.kv_mask is None else self.kv_mask

    def resolved_warmup(self) -> float:
        """Warm-up seconds for this mode."""
        if self.warmup is not None:
            return self.warmup
        return OFFLINE_WARMUP_S if self.mode == "offline" else ONLINE_WARMUP_S


def batch_policy(throttle: bool | str):
    """The node batching policy: Helix's caps, gLLM throttling, prefill-only throttling, or
    throttling with chunked prefill."""
    if throttle in (False, None, "off"):
        return CapsPolicy()
    if throttle in (True, "on"):
        return ThrottlePolicy()
    if throttle == "prefill":
        return ThrottlePolicy(throttle_decode=False)
    if throttle == "chunked":
        return ThrottlePolicy(chunk_prefill=True)
    raise ConfigError(f"throttle must be off, on, prefill or chunked, not {throttle!r}")


def build_sim(scenario: Scenario, cfg: SimConfig, loop: EventLoop | None = None) -> ClusterSim:
    """Wire a :class:`ClusterSim` for ``scenario`` under ``cfg`` (workload not yet attached), on
    ``loop`` (None: its own)."""
    if cfg.kv_model not in ("reserve", "vllm"):
        raise ConfigError(f"kv model must be reserve or vllm, not {cfg.kv_model!r}")
    if cfg.mode not in ("offline", "online"):
        raise ConfigError(f"mode must be offline or online, not {cfg.mode!r}")
    kv_settings = cfg.kv or (KvSettings.offline() if cfg.mode == "offline" else KvSettings.online())
    caps = {i: a.kv_capacity for i, a in scenario.graph.assignments.items()}
    kv = KvEstimator(caps, kv_settings, scenario.layer_capacity)
    rng = random.Random(cfg.seed)
    scheduler = make_scheduler(cfg.scheduler, scenario.flows, rng, scenario.graph)
    warm = cfg.resolved_warmup()
    return ClusterSim(
        client_graph(scenario.graph, cfg.transport),
        scheduler,
        kv,
        scenario.latencies,
        speed_prior=scenario.speed_prior,
        batch_policy=batch_policy(cfg.throttle),
        window=(warm, warm + cfg.duration),
        entry_overhead=cfg.entry_overhead,
        kv_mask=cfg.resolved_kv_mask(),
        kv_model=cfg.kv_model,
        transport=cfg.transport,
        spec_seed=cfg.seed + 3,
        loop=loop,
    )


def simulate(scenario: Scenario, cfg: SimConfig) -> SimResult:
    """Run ``cfg`` on ``scenario`` and return the measurements."""
    sim = build_sim(scenario, cfg)
    inputs, outputs = load_lengths(cfg.lengths, scenario.root)
    sampler = LengthSampler(inputs, outputs, np.random.default_rng(cfg.seed + 1))
    end = cfg.resolved_warmup() + cfg.duration
    extra: dict = {
        "scheduler": cfg.scheduler,
        "mode": cfg.mode,
        "throttle": cfg.throttle,
        "kv_mask": cfg.resolved_kv_mask(),
        "kv_model": cfg.kv_model,
    }
    extra.update(scenario.describe())
    extra.update(cfg.transport.describe())
    if cfg.mode == "offline":
        attach_offline(sim, sampler, cfg.feeding)
    else:
        if cfg.token_rate is None or cfg.token_rate <= 0:
            raise ConfigError("online mode needs a positive token rate (--rate)")
        n, in_window = _attach_online(sim, sampler, cfg, end, scenario.root)
        extra["token_rate"] = cfg.token_rate
        extra["arrivals"] = n
        extra["arrivals_in_window"] = in_window
    t, c = time.perf_counter(), time.process_time()
    sim.loop.run(end + (cfg.drain if cfg.mode == "online" else 0.0))
    wall = time.perf_counter() - t
    # CPU seconds too: the machine is shared, so wall time alone says little about our speed.
    extra["cpu_s"] = time.process_time() - c
    return sim.result(wall, extra)


def attach_offline(sim, sampler: LengthSampler, feeding: OfflineFeeding) -> None:
    """Feed queries as fast as the cluster takes them (Helix's offline rule). ``sim`` is a
    ClusterSim, or anything with its ``loop``, ``submit``, ``pending``, ``kv.max_layer_usage`` and
    the two done hooks (``sim/disagg.py``'s SplitSim)."""
    state = {"next_id": 0, "batch": [], "pos": 0}

    def new_query() -> Query:
        if state["pos"] >= len(state["batch"]):
            state["batch"] = sampler.draw(4096)
            state["pos"] = 0
        inp, out = state["batch"][state["pos"]]
        state["pos"] += 1
        q = Query(state["next_id"], inp, out, sim.loop.now)
        state["next_id"] += 1
        return q

    def top_up(_arg=None) -> None:
        kv = sim.kv
        while not sim.pending and kv.max_layer_usage() <= feeding.max_usage:
            if not sim.submit(new_query()):
                break

    def start(_arg=None) -> None:
        for _ in range(feeding.initial):
            sim.submit(new_query())
        top_up()

    sim.hooks.done.append(lambda q: top_up())
    sim.hooks.prompt_done.append(lambda q: top_up())
    sim.loop.at(0.0, start)


def _attach_online(sim: ClusterSim, sampler: LengthSampler, cfg: SimConfig, until: float,
                   root: Path | None) -> tuple[int, int]:
    """Schedule the arrivals (a trace's counts rescaled, or Poisson at a constant rate); returns
    how many there are and how many fall in the measurement window."""
    counts = np.ones(1) if cfg.arrivals == "poisson" else load_arrival_counts(cfg.arrivals, root)
    rng = np.random.default_rng(cfg.seed + 2)
    times = online_arrival_times(counts, cfg.token_rate, sampler.mean_tokens(), until, rng)
    pairs = sampler.draw(len(times))

    def arrive(q: Query) -> None:
        sim.submit(q)

    for qid, (t, (inp, out)) in enumerate(zip(times.tolist(), pairs)):
        sim.loop.at(t, arrive, Query(qid, inp, out, t))
    return len(times), int(((times >= until - cfg.duration) & (times <= until)).sum())
