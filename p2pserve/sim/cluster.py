"""The simulated cluster: nodes and links wired by a routing graph, driven by a scheduler.

This is the composition root of one simulation. The coordinator is the source and the sink:
it routes a new query (asking the scheduler), sends the prompt job to the first stage, and each
time a job's token comes back it sends the next decode job down the same route, until the query
has produced ``output_len`` tokens; then the query's KV reservation is released and queries
waiting for a route are retried (FIFO).
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping

from p2pserve.sim.batching import CapsPolicy
from p2pserve.sim.engine import EventLoop
from p2pserve.sim.graph import StageGraph
from p2pserve.sim.kv import KvEstimator
from p2pserve.sim.link import Link
from p2pserve.sim.metrics import Distribution, Recorder, SimResult
from p2pserve.sim.node import Node, entry_overhead_per_token
from p2pserve.sim.profiles import LayerLatency
from p2pserve.sim.request import Query, Stage
from p2pserve.sim.schedulers.base import Scheduler
from p2pserve.sim.transport import ClientRelay, TransportConfig, draw_accepted
from p2pserve.types import SINK_INDEX, SOURCE_INDEX


Listener = Callable[[Query], None]


@dataclass
class QueryHooks:
    """Who a simulation tells about its queries, in order of subscription: the offline feeder
    (``run.attach_offline``) and the prefill/decode split (``sim/disagg.py``) subscribe here."""

    done: list[Listener] = field(default_factory=list)  # a query finished decoding
    prompt_done: list[Listener] = field(default_factory=list)  # a query's prompt left its last stage
    # a prefilled query took its decode route (the split moves its KV); none: its KV is assumed there
    decode_route: list[Listener] = field(default_factory=list)


def tell(listeners: list[Listener], query: Query) -> None:
    """Call each of ``listeners`` with ``query``."""
    for fn in listeners:
        fn(query)


class ClusterSim:
    """One cluster under one scheduler; implements :class:`SchedulerView` for it."""

    def __init__(
        self,
        graph: StageGraph,
        scheduler: Scheduler,
        kv: KvEstimator,
        latencies: Mapping[int, LayerLatency],
        *,
        speed_prior: Mapping[int, float] | None = None,
        batch_policy=None,
        window: tuple[float, float] = (0.0, float("inf")),
        loop: EventLoop | None = None,
        entry_overhead: bool = True,
        kv_mask: bool = True,
        kv_model: str = "reserve",
        transport: TransportConfig | None = None,
        spec_seed: int = 0,
    ) -> None:
        self.loop = loop if loop is not None else EventLoop()
        self.graph = graph
        self.scheduler = scheduler
        self.kv = kv
        self.latencies = dict(latencies)
        self.kv_mask = kv_mask  # apply Helix's KV estimate as a routing mask
        self.recorder = Recorder(*window)
        self.pending: deque[Query] = deque()
        self.submitted = 0
        self.routed = 0
        self.depth_total = 0
        self.hooks = QueryHooks()
        self._speed_prior = dict(speed_prior or {})
        policy = batch_policy if batch_policy is not None else CapsPolicy()
        self._policy = policy
        overhead = entry_overhead_per_token(graph.activation_bytes) if entry_overhead else 0.0
        self.nodes: dict[int, Node] = {}
        for idx, a in graph.assignments.items():
            self.nodes[idx] = Node(
                self.loop, idx, a.start, a.end, self.latencies[idx], a.caps, overhead,
                self._node_exit, policy=policy, kv_free=kv.free_fraction,
                kv_capacity=a.kv_capacity, kv_mode=kv_model,
            )
        # One Link object per directed pair the routing graph can use.
        self.links: dict[tuple[int, int], Link] = {}
        for u, edges in graph.out_edges.items():
            for e in edges:
                deliver = self._at_sink if e.dst == SINK_INDEX else self.nodes[e.dst].receive
                self.links[(u, e.dst)] = Link(
                    self.loop, u, e.dst, graph.bytes_per_s(u, e.dst), graph.latency(u, e.dst), deliver
                )
        self._token_bytes = graph.token_bytes
        self._act_bytes = graph.activation_bytes
        # transport mode and speculation (``sim/transport.py``)
        self.transport = transport if transport is not None else TransportConfig()
        self._relay = ClientRelay(self, self._at_sink) if self.transport.mode == "client" else None
        self._spec_rng = random.Random(spec_seed)
        if self.transport.spec_k:
            for n in self.nodes.values():
                n.multi_token = True

    # ------------------------------------------------------------ SchedulerView
    def admissible(self, stage: Stage, query: Query) -> bool:
        """Mask a stage when the prompt exceeds its node's prompt cap or (with ``kv_mask``) the
        node's KV estimate cannot take the stage's layers."""
        if not query.prefilled and query.input_len > self.graph.assignments[stage.node].caps.prompt_max_tokens:
            return False
        if not self.kv_mask:
            return True
        need = self.kv.tokens_per_layer(query.input_len) * stage.layers
        return self.kv.fits(stage.node, need)

    def queued_tokens(self, node: int) -> int:
        """Tokens of jobs inside ``node``."""
        return self.nodes[node].queued_tokens

    def speed(self, node: int) -> float:
        """Measured token-layers/s once a node has run a few batches, else the prior."""
        n = self.nodes[node]
        if n.batches >= 16:
            return n.speed()
        return self._speed_prior.get(node, 1.0)

    def layer_time(self, node: int, tokens: int, prompt: bool) -> float:
        """Profiled seconds for one layer of ``node``."""
        lat = self.latencies[node]
        return lat.prompt(tokens) if prompt else lat.decode(tokens)

    # ------------------------------------------------------------ coordinator
    def submit(self, query: Query) -> bool:
        """A query arrives: route it now, or queue it until a route becomes admissible."""
        self.submitted += 1
        if self.pending or not self._try_start(query):
            self.pending.append(query)
            return False
        return True

    def _try_start(self, query: Query) -> bool:
        route = self.scheduler.route(query, self)
        if route is None:
            return False
        query.route = route
        self.kv.reserve(query)
        self.routed += 1
        self.depth_total += len(route)
        if query.prefilled:  # its prompt ran on other nodes: decode from the first step
            self._begin_decode(query)
            if self.hooks.decode_route:
                tell(self.hooks.decode_route, query)
            else:
                self.start_decode(query)
            return True
        query.is_prompt = True
        query.tokens = query.input_len
        self._emit([query])
        return True

    def start_decode(self, query: Query) -> None:
        """A prefilled query's KV has reached its decode route: send its first decode job."""
        query.job_start = self.loop.now
        self._emit([query])

    def _begin_decode(self, query: Query) -> None:
        """``query``'s prompt is done (here or elsewhere): its jobs are one-token decodes now."""
        query.is_prompt = False
        query.tokens = 1
        self._count_running(query, 1)

    def _count_running(self, query: Query, sign: int) -> None:
        """Token throttling's per-node count of running decodes and their route depths."""
        if self._policy.dynamic:
            depth = len(query.route)
            for st in query.route:
                n = self.nodes[st.node]
                n.running_decodes += sign
                n.depth_sum += sign * depth

    def retry_pending(self) -> None:
        """Start waiting queries in arrival order until one still cannot be routed."""
        pending = self.pending
        while pending:
            if not self._try_start(pending[0]):
                return
            pending.popleft()

    def _emit(self, jobs: list[Query]) -> None:
        """Send jobs from the coordinator to their first stage, one message per first node."""
        now = self.loop.now
        by_dst: dict[int, list[Query]] = {}
        for j in jobs:
            j.hop = 0
            j.job_start = now
            dst = j.route[0].node
            lst = by_dst.get(dst)
            if lst is None:
                by_dst[dst] = [j]
            else:
                lst.append(j)
        tb = self._token_bytes
        for dst, lst in by_dst.items():
            self.links[(SOURCE_INDEX, dst)].send(lst, tb * sum(j.tokens for j in lst))

    def _node_exit(self, node: Node, jobs: list[Query]) -> None:
        """Jobs finished their stage on ``node``: forward each to its next hop (peer to peer), or
        back to the client when it drives the pipeline."""
        if self._relay is not None:
            self._relay.node_exit(node, jobs)
            return
        src = node.idx
        by_dst: dict[int, list[Query]] = {}
        for j in jobs:
            j.hop += 1
            dst = j.route[j.hop].node if j.hop < len(j.route) else SINK_INDEX
            lst = by_dst.get(dst)
            if lst is None:
                by_dst[dst] = [j]
            else:
                lst.append(j)
        links = self.links
        for dst, lst in by_dst.items():
            if dst == SINK_INDEX:
                # a sampled token id per job; a verify step returns one per position
                nbytes = self._token_bytes * sum(1 if j.is_prompt else j.tokens for j in lst)
            else:
                nbytes = self._act_bytes * sum(j.tokens for j in lst)
            links[(src, dst)].send(lst, nbytes)

    def _at_sink(self, jobs: list[Query]) -> None:
        """Tokens come back to the coordinator; start each query's next decode job."""
        now = self.loop.now
        rec = self.recorder
        sched = self.scheduler
        again: list[Query] = []
        done: list[Query] = []
        for j in jobs:
            if j.is_prompt:
                j.prompt_done = now
                rec.prompt(now, now - j.arrival)
                self._begin_decode(j)
                tell(self.hooks.prompt_done, j)
            else:
                made = 1 + draw_accepted(self._spec_rng, self.transport.acceptance, j.tokens - 1)
                rec.decode(now, now - j.job_start, made)
                j.decoded += made
            if j.decoded >= j.output_len:
                done.append(j)
            else:
                # the next step: the pending token and up to spec_k drafts (never past output_len)
                j.tokens = 1 + min(self.transport.spec_k, j.output_len - j.decoded - 1)
                sched.on_decode(j)
                again.append(j)
        if again:
            self._emit(again)
        for j in done:
            self._finish(j)

    def _finish(self, query: Query) -> None:
        now = self.loop.now
        query.finished = now
        self.recorder.finish(now, query)
        self.kv.release(query)
        nodes = self.nodes
        for st in query.route:
            nodes[st.node].release(query)
        self.scheduler.on_finish(query)
        self._count_running(query, -1)  # counted when its decode began (every finished query did)
        self.retry_pending()
        tell(self.hooks.done, query)

    # ------------------------------------------------------------ results
    def result(self, wall_s: float, extra: dict | None = None) -> SimResult:
        """Summarise the run so far."""
        rec = self.recorder
        t0 = rec.t0
        t1 = min(rec.t1, self.loop.now)
        window = max(t1 - t0, 1e-12)
        now = max(self.loop.now, 1e-12)
        return SimResult(
            decode_throughput_tokens_per_s=rec.decode_tokens / window,
            prompt_latency_s=Distribution.of(rec.prompt_lat),
            decode_latency_s=Distribution.of(rec.decode_lat),
            window_s=window,
            queries_submitted=self.submitted,
            queries_finished_in_window=rec.finished,
            queries_waiting_at_end=len(self.pending),
            simulated_s=self.loop.now,
            wall_s=wall_s,
            events=self.loop.events_run,
            avg_route_depth=self.depth_total / self.routed if self.routed else 0.0,
            node_utilization={i: n.busy_time / now for i, n in sorted(self.nodes.items())},
            extra=dict(
                extra or {},
                kv_gate_waits=sum(n.kv_waits for n in self.nodes.values()),
                kv_preemptions=sum(n.preemptions for n in self.nodes.values()),
            ),
            completions=list(rec.completions),
        )


def run_until(sim: ClusterSim, until: float) -> float:
    """Advance ``sim`` to ``until``; returns the wall-clock seconds it took."""
    t = time.perf_counter()
    sim.loop.run(until)
    return time.perf_counter() - t
