"""A compute node: runs its layers one at a time, round-robin over per-layer FIFO queues.

Semantics follow the Helix simulator (see ``shared/data/helix/README.md``):

* a job (prompt or decode) entering the node at layer ``s`` waits in layer ``s``'s queue;
* the node serves one layer at a time, picking the next non-empty layer queue after the one it
  just ran (round-robin), and takes a FIFO batch from it capped by the batching policy —
  dynamic batching: everything that arrived meanwhile joins, nothing waits on purpose;
* the batch costs ``P(prompt tokens) + D(decode tokens)`` for that layer, with ``D`` doubled for
  exactly one decode token, plus a concat/transfer overhead per token entering the node here;
* after the layer, jobs whose stage ends there leave through ``on_exit``; the rest move on to
  the next layer's queue.

KV cache: a node holds ``kv_capacity`` token-layer entries. A query's prompt is admitted only
when its whole footprint ``(input + output) * layers`` fits (vLLM would otherwise have to preempt
or swap sessions); otherwise it waits, FIFO, until finished queries release entries. The
footprint uses the query's true output length — an optimistic stand-in for vLLM's incremental
allocation with preemption. Schedulers that keep Helix's KV estimate never make a node wait
here; schedulers without it can over-subscribe a node and stall behind this gate.
"""

from __future__ import annotations

from typing import Callable

from p2pserve.sim.batching import BatchCaps, CapsPolicy
from p2pserve.sim.engine import EventLoop
from p2pserve.sim.profiles import LayerLatency
from p2pserve.sim.request import Query

#: Helix's first-layer overhead: per entering token, act/(4 Gbps) + act/(5 Gbps) seconds,
#: with "Gbps" read as bytes/s like the link bandwidths.
CONCAT_BANDWIDTH = 4e9
TRANSFER_BANDWIDTH = 5e9


def entry_overhead_per_token(activation_bytes: float) -> float:
    """Seconds per token entering a node (concat + host transfer), Helix's constants."""
    return activation_bytes / CONCAT_BANDWIDTH + activation_bytes / TRANSFER_BANDWIDTH


class Node:
    """One GPU node holding layers ``[start, end)``."""

    __slots__ = (
        "loop", "idx", "start", "end", "k", "latency", "caps", "policy", "overhead",
        "on_exit", "kv_free", "pq", "dq", "busy", "ptr", "queued_tokens", "busy_time",
        "batches", "work_ema", "time_ema", "running_decodes", "depth_sum", "_p", "_d",
        "kv_capacity", "kv_used", "kv_held", "kv_wait", "kv_waits",
    )

    def __init__(
        self,
        loop: EventLoop,
        idx: int,
        start: int,
        end: int,
        latency: LayerLatency,
        caps: BatchCaps,
        overhead_per_token: float,
        on_exit: Callable[["Node", list[Query]], None],
        policy=None,
        kv_free: Callable[[int], float] | None = None,
        kv_capacity: int = 0,
    ) -> None:
        self.loop = loop
        self.idx = idx
        self.start = start
        self.end = end
        self.k = end - start
        self.latency = latency
        self.caps = caps
        self.policy = policy if policy is not None else CapsPolicy()
        self.overhead = overhead_per_token
        self.on_exit = on_exit
        self.kv_free = kv_free  # node idx -> free KV fraction (for token throttling)
        self.pq: list[list[Query]] = [[] for _ in range(self.k)]  # prompt jobs per local layer
        self.dq: list[list[Query]] = [[] for _ in range(self.k)]  # decode jobs per local layer
        self.busy = False
        self.ptr = self.k - 1  # last layer served; the first search starts at local layer 0
        self.queued_tokens = 0  # tokens of jobs inside the node (shortest-queue uses it)
        self.busy_time = 0.0
        self.batches = 0
        # Exponentially weighted token-layers and seconds: a "real-time throughput" estimate
        # (token-layers per busy second) for Swarm-style routing.
        self.work_ema = 0.0
        self.time_ema = 0.0
        self.running_decodes = 0  # decode-phase queries whose route passes here (throttling)
        self.depth_sum = 0  # sum of their route depths
        self.kv_capacity = kv_capacity  # token-layer entries; 0 = unlimited
        self.kv_used = 0
        self.kv_held: dict[int, int] = {}  # qid -> entries held
        self.kv_wait: list[Query] = []  # prompts waiting for KV space, FIFO
        self.kv_waits = 0  # how many prompts had to wait (diagnostic)
        # prompt/decode latency tables bound locally for the hot path
        self._p = latency.prompt_s
        self._d = latency.decode_s

    # ---------------------------------------------------------------- inputs
    def receive(self, jobs: list[Query]) -> None:
        """Jobs arrive (one link message); each joins the queue of its stage's first layer."""
        start = self.start
        pq, dq = self.pq, self.dq
        tokens = 0
        cap = self.kv_capacity
        for j in jobs:
            st = j.route[j.hop]
            j.entry = st.start
            j.exit = st.end
            tokens += j.tokens
            if j.is_prompt:
                if cap:
                    need = (j.input_len + j.output_len) * (st.end - st.start)
                    if self.kv_wait or self.kv_used + need > cap:
                        self.kv_wait.append(j)
                        self.kv_waits += 1
                        continue
                    self.kv_used += need
                    self.kv_held[j.qid] = need
                pq[st.start - start].append(j)
            else:
                dq[st.start - start].append(j)
        self.queued_tokens += tokens
        if not self.busy:
            self._next()

    def release(self, query: Query) -> None:
        """``query`` finished: free its KV entries and admit waiting prompts that now fit."""
        need = self.kv_held.pop(query.qid, 0)
        if not need:
            return
        self.kv_used -= need
        wait = self.kv_wait
        admitted = 0
        while wait:
            j = wait[0]
            need = (j.input_len + j.output_len) * (j.exit - j.entry)
            if self.kv_used + need > self.kv_capacity:
                break
            wait.pop(0)
            self.kv_used += need
            self.kv_held[j.qid] = need
            self.pq[j.entry - self.start].append(j)
            admitted += 1
        if admitted and not self.busy:
            self._next()

    def speed(self) -> float:
        """Measured token-layers per busy second (0 before the first batch)."""
        return self.work_ema / self.time_ema if self.time_ema > 0 else 0.0

    def resident_jobs(self) -> int:
        """Jobs waiting in or running through this node's layer queues."""
        return sum(len(q) for q in self.pq) + sum(len(q) for q in self.dq)

    # ---------------------------------------------------------------- batching
    def _next(self) -> None:
        k = self.k
        pq, dq = self.pq, self.dq
        li = self.ptr
        for _ in range(k):
            li += 1
            if li == k:
                li = 0
            if pq[li] or dq[li]:
                break
        else:
            self.busy = False
            return
        self.busy = True
        self.ptr = li
        layer = self.start + li
        caps = self.caps
        if self.policy.dynamic:
            waiting = sum(j.tokens for j in pq[li])
            free = self.kv_free(self.idx) if self.kv_free is not None else 1.0
            depth = self.depth_sum / self.running_decodes if self.running_decodes else 1.0
            max_req, max_tok, max_dec = self.policy.limits(
                caps, waiting, free, self.running_decodes, depth
            )
        else:
            max_req, max_tok, max_dec = (
                caps.prompt_max_requests, caps.prompt_max_tokens, caps.decode_max_tokens
            )

        # Prompts: FIFO while under both caps; the head always goes (a lone prompt larger than
        # the token cap would otherwise block the queue forever).
        q = pq[li]
        bp: list[Query] = []
        ptok = 0
        entering = 0
        if q:
            n = 0
            for j in q:
                if n and (n >= max_req or ptok + j.tokens > max_tok):
                    break
                n += 1
                ptok += j.tokens
                if j.entry == layer:
                    entering += j.tokens
            if n == len(q):
                bp = q
                pq[li] = []
            else:
                bp = q[:n]
                del q[:n]
        # Decodes: FIFO up to the decode cap.
        q = dq[li]
        if len(q) <= max_dec:
            bd = q
            dq[li] = []
        else:
            bd = q[:max_dec]
            del q[:max_dec]
        nd = len(bd)
        if nd:
            for j in bd:
                if j.entry == layer:
                    entering += 1

        p = self._p
        dt = p[ptok] if ptok < len(p) else self.latency.prompt(ptok)
        if nd:
            d = self._d
            t = d[nd] if nd < len(d) else self.latency.decode(nd)
            dt += t + t if nd == 1 else t
        dt += entering * self.overhead
        self.busy_time += dt
        self.batches += 1
        self.work_ema = 0.99 * self.work_ema + ptok + nd
        self.time_ema = 0.99 * self.time_ema + dt
        self.loop.after(dt, self._done, (li, bp, bd))

    def _done(self, batch: tuple[int, list[Query], list[Query]]) -> None:
        li, bp, bd = batch
        nxt = li + 1
        out: list[Query]
        if nxt == self.k:
            out = bp + bd if bp else bd
        else:
            layer_end = self.start + nxt
            out = []
            if bp:
                cont = self.pq[nxt]
                for j in bp:
                    if j.exit == layer_end:
                        out.append(j)
                    else:
                        cont.append(j)
            if bd:
                leaving = [j for j in bd if j.exit == layer_end]
                if leaving:
                    out.extend(leaving)
                    bd = [j for j in bd if j.exit != layer_end]
                cont = self.dq[nxt]
                if cont:
                    cont.extend(bd)
                else:
                    self.dq[nxt] = bd
        if out:
            self.queued_tokens -= sum(j.tokens for j in out)
            self.on_exit(self, out)
        self._next()
