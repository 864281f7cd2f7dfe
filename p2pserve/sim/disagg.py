"""Prefill/decode disaggregation in the simulator (HexGen-2, ThunderServe, DistServe's split).

Some nodes run prompts only, the others decode steps only, each side with its own placement of
the whole model, its own max-flow and its own IWRR scheduler; both run on one event loop. A
query's prompt runs through a route of the prefill side, which produces its first token. The
query then asks the decode side for a route (waiting, FIFO, while the decode nodes' KV estimate
masks every route). Once it has one, the prompt's KV moves to that route: for each pair of a
prefill stage and a decode stage whose layers overlap, ``overlap layers x prompt tokens x
kv_bytes`` bytes go over the link between the two nodes (one FIFO link per directed pair, as for
activations, ``sim/link.py``). When every part has arrived, its decode steps run on the decode
route until ``output_len`` tokens. A decode node admits the query's KV like a prompt's (whole
footprint), and never runs a prompt, so no decode batch waits behind one.

What is not modelled: the prefill nodes keep a prompt's KV only until its prompt ends (not until
it has been sent), and the links carry KV and activations in separate queues. The prefill side's
KV mask reserves a prompt's expected output too (Helix's estimate, unchanged), so it admits
prompts conservatively.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from p2pserve.errors import ConfigError
from p2pserve.sim.cluster import ClusterSim, QueryHooks, tell
from p2pserve.sim.link import Link
from p2pserve.sim.metrics import SimResult
from p2pserve.sim.request import Query, Stage
from p2pserve.sim.run import SimConfig, attach_offline, build_sim
from p2pserve.sim.scenario import Placement, Scenario
from p2pserve.sim.workload import LengthSampler, load_lengths

#: K and V of one token in one layer, fp16: ``2 * kv_heads * head_dim * 2`` bytes.
KV_BYTES_PER_TOKEN_LAYER = {"llama2-70b": 2 * 8 * 128 * 2, "llama1-30b": 2 * 52 * 128 * 2}


@dataclass(frozen=True)
class SplitPlacement:
    """Which nodes run prompts and which run decode steps, each side covering every layer."""

    prefill: Placement
    decode: Placement

    def validate(self) -> None:
        """A node serves one side only."""
        both = set(self.prefill) & set(self.decode)
        if both:
            raise ConfigError(f"nodes {sorted(both)} are on both sides of the split")


def kv_parts(prompt_route: tuple[Stage, ...], decode_route: tuple[Stage, ...], tokens: int,
             kv_bytes: int) -> list[tuple[int, int, int]]:
    """``(from node, to node, bytes)`` of each piece of a prompt's KV that must move."""
    parts = []
    for d in decode_route:
        for p in prompt_route:
            lo, hi = max(p.start, d.start), min(p.end, d.end)
            if lo < hi:
                parts.append((p.node, d.node, (hi - lo) * tokens * kv_bytes))
    return parts


class KvTransfer:
    """Moves prefilled queries' KV from their prompt routes to their decode routes."""

    def __init__(self, decode: ClusterSim, kv_bytes: int) -> None:
        self.decode = decode
        self.kv_bytes = kv_bytes
        self.links: dict[tuple[int, int], Link] = {}
        self._outstanding: dict[int, int] = {}
        self._started: dict[int, float] = {}
        self.bytes = 0.0
        self.prompt_tokens = 0  # prompt tokens whose KV was sent (every layer of each, once)
        self.seconds: list[float] = []  # per query, start to last part delivered
        decode.hooks.decode_route.append(self.start)

    def start(self, query: Query) -> None:
        """``query`` has its decode route: send every part of its KV."""
        parts = kv_parts(query.prompt_route, query.route, query.input_len, self.kv_bytes)
        self.prompt_tokens += query.input_len
        if not parts:
            self.decode.start_decode(query)
            return
        self._outstanding[query.qid] = len(parts)
        self._started[query.qid] = self.decode.loop.now
        for u, v, nbytes in parts:
            self._link(u, v).send([query], nbytes)
            self.bytes += nbytes

    def _link(self, u: int, v: int) -> Link:
        link = self.links.get((u, v))
        if link is None:
            g = self.decode.graph
            link = Link(self.decode.loop, u, v, g.bytes_per_s(u, v), g.latency(u, v), self._arrived)
            self.links[(u, v)] = link
        return link

    def _arrived(self, jobs: list[Query]) -> None:
        for q in jobs:
            left = self._outstanding[q.qid] - 1
            if left:
                self._outstanding[q.qid] = left
                continue
            del self._outstanding[q.qid]
            self.seconds.append(self.decode.loop.now - self._started.pop(q.qid))
            self.decode.start_decode(q)


class SplitSim:
    """A prefill side and a decode side on one event loop, joined by :class:`KvTransfer`."""

    def __init__(self, prefill: Scenario, decode: Scenario, cfg: SimConfig, kv_bytes: int) -> None:
        if cfg.kv_model != "reserve":
            raise ConfigError("the prefill/decode split simulates the reserve KV model only")
        self.prefill = build_sim(prefill, cfg)
        self.decode = build_sim(decode, replace(cfg, seed=cfg.seed + 7), loop=self.prefill.loop)
        self.loop = self.prefill.loop
        self.transfer = KvTransfer(self.decode, kv_bytes)
        self._outputs: dict[int, int] = {}
        self.prefill.hooks.done.append(self._prompt_done)
        # as ClusterSim's, for the feeder: a query is done when its decode side is
        self.hooks = QueryHooks(done=self.decode.hooks.done)

    # What ``run.attach_offline`` reads of a ClusterSim, over both sides.
    def submit(self, query: Query) -> bool:
        """A query arrives at the prefill side (its decode comes later)."""
        self._outputs[query.qid] = query.output_len
        return self.prefill.submit(Query(query.qid, query.input_len, 0, query.arrival))

    @property
    def pending(self) -> bool:
        """Whether either side has queries waiting for a route."""
        return bool(self.prefill.pending or self.decode.pending)

    @property
    def kv(self) -> "SplitSim":
        return self  # ``max_layer_usage`` below

    def max_layer_usage(self) -> float:
        """The fuller side's most used layer (the offline feeding rule reads it)."""
        return max(self.prefill.kv.max_layer_usage(), self.decode.kv.max_layer_usage())

    def _prompt_done(self, q: Query) -> None:
        d = Query(q.qid, q.input_len, self._outputs.pop(q.qid), q.arrival)
        d.prefilled, d.prompt_route, d.prompt_done = True, q.route, q.prompt_done
        self.decode.submit(d)
        tell(self.hooks.prompt_done, q)

    def result(self, wall_s: float, extra: dict) -> SimResult:
        """The decode side's figures, with the prompt latencies of the prefill side."""
        res = self.decode.result(wall_s, extra)
        pre = self.prefill.result(wall_s)
        util = dict(res.node_utilization)
        util.update(pre.node_utilization)
        t = self.transfer
        res.extra.update(
            kv_transfer_gb=round(t.bytes / 1e9, 3),
            kv_transfer_s_mean=round(sum(t.seconds) / len(t.seconds), 4) if t.seconds else None,
            prefill_nodes=sorted(self.prefill.nodes), decode_nodes=sorted(self.decode.nodes),
            prompts_waiting_at_end=len(self.prefill.pending),
            kv_prompt_tokens=t.prompt_tokens,
            decode_prompt_tokens_run=sum(n.prompt_tokens_run for n in self.decode.nodes.values()),
        )
        return replace(res, prompt_latency_s=pre.prompt_latency_s, node_utilization=dict(sorted(util.items())),
                       queries_submitted=pre.queries_submitted)


def simulate_split(prefill: Scenario, decode: Scenario, cfg: SimConfig, kv_bytes: int | None = None) -> SimResult:
    """Run ``cfg`` (offline only) on a prefill/decode split; see the module docstring."""
    if cfg.mode != "offline":
        raise ConfigError("the prefill/decode split is simulated offline only")
    if kv_bytes is None:
        if decode.model not in KV_BYTES_PER_TOKEN_LAYER:
            raise ConfigError(f"no KV size known for {decode.model}; pass kv_bytes")
        kv_bytes = KV_BYTES_PER_TOKEN_LAYER[decode.model]
    sim = SplitSim(prefill, decode, cfg, kv_bytes)
    inputs, outputs = load_lengths(cfg.lengths, decode.root)
    sampler = LengthSampler(inputs, outputs, np.random.default_rng(cfg.seed + 1))
    end = cfg.resolved_warmup() + cfg.duration
    attach_offline(sim, sampler, cfg.feeding)  # Helix's rule over both sides: either waiting or full stops it
    t, c = time.perf_counter(), time.process_time()
    sim.loop.run(end)
    extra = {"scheduler": cfg.scheduler, "mode": cfg.mode, "throttle": cfg.throttle, "split": True,
             "cpu_s": time.process_time() - c}
    extra.update(decode.describe())
    return sim.result(time.perf_counter() - t, extra)


def simulated_split(cluster, model: str, split: SplitPlacement, duration: float = 600.0, warmup: float = 60.0,
                    seed: int = 0, throttle: bool | str = False, root=None) -> SimResult:
    """``split`` on a Helix cluster file, offline, IWRR on each side (``throttle``: both sides'
    batching, which on the decode side, never given a prompt, changes only the decode budget;
    ``root``: the Helix data root)."""
    from p2pserve.sim.scenario import Part, build_scenario

    split.validate()
    return simulate_split(build_scenario(model, [Part(cluster, dict(split.prefill))], root=root),
                          build_scenario(model, [Part(cluster, dict(split.decode))], root=root),
                          SimConfig(duration=duration, warmup=warmup, seed=seed, throttle=throttle))
