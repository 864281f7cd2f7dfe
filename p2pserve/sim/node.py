"""A compute node: runs its layers one at a time, round-robin over per-layer FIFO queues.

Semantics follow the Helix simulator (see ``p2pserve/helix/data/README.md``):

* a job (prompt or decode) entering the node at layer ``s`` waits in layer ``s``'s queue;
* the node serves one layer at a time, picking the next non-empty layer queue after the one it
  just ran (round-robin), and takes a FIFO batch from it capped by the batching policy —
  dynamic batching: everything that arrived meanwhile joins, nothing waits on purpose;
* the batch costs ``P(prompt tokens) + D(decode tokens)`` for that layer, with ``D`` doubled for
  exactly one decode token, plus a concat/transfer overhead per token entering the node here;
* after the layer, jobs whose stage ends there leave through ``on_exit``; the rest move on to
  the next layer's queue.

KV cache: a node holds ``kv_capacity`` token-layer entries, under one of two models.
``reserve``: a query's prompt is admitted only when its whole footprint ``(input + output) *
layers`` fits; otherwise it waits, FIFO, until finished queries release entries (optimistic: no
work is ever lost). ``vllm``: entries are allocated as tokens arrive and, when a decode step finds
the node full, the latest admitted session is preempted and must later recompute its context
(vLLM's recompute preemption; see :meth:`Node._vllm_admit`). Schedulers that keep Helix's KV
estimate rarely reach either limit; schedulers without it can over-subscribe a node.
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
        "kv_capacity", "kv_used", "kv_held", "kv_wait", "kv_waits", "kv_mode", "kv_evicted",
        "preemptions", "recomputes", "_running", "multi_token", "prompt_tokens_run",
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
        kv_mode: str = "reserve",
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
        self.kv_mode = kv_mode  # "reserve": whole footprint at admission; "vllm": see _vllm_admit
        self.kv_evicted: set[int] = set()  # sessions preempted here, to recompute on next visit
        self.preemptions = 0
        self.recomputes = 0
        self.prompt_tokens_run = 0  # prompt token-layers computed here
        self._running: list[Query] = []  # jobs of the batch being computed
        self.multi_token = False  # decode jobs may carry several tokens (speculative verify steps)
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
        vllm = self.kv_mode == "vllm"
        for j in jobs:
            st = j.route[j.hop]
            j.entry = st.start
            j.exit = st.end
            if cap:
                if vllm:
                    if not self._vllm_admit(j):
                        tokens += j.tokens
                        continue
                elif j.is_prompt or (j.prefilled and j.qid not in self.kv_held):  # a session's first job here
                    need = (j.input_len + j.output_len) * (st.end - st.start)
                    if self.kv_wait or self.kv_used + need > cap:
                        tokens += j.tokens
                        self.kv_wait.append(j)
                        self.kv_waits += 1
                        continue
                    self.kv_used += need
                    self.kv_held[j.qid] = need
            tokens += j.tokens
            if j.is_prompt or j.recompute:
                pq[st.start - start].append(j)
            else:
                dq[st.start - start].append(j)
        self.queued_tokens += tokens
        if not self.busy:
            self._next()

    def _vllm_admit(self, j: Query) -> bool:
        """vLLM-like KV: allocate as tokens arrive, preempt (recompute) when full.

        A prompt needs ``input * layers`` entries and waits (FIFO) while they are not free. A
        decode step needs ``layers`` more; when the node is full, the most recently admitted
        other session not inside the node is preempted — its entries are dropped and its next
        job here must first recompute its whole context, like vLLM's recompute preemption. A
        preempted session's job (or a decode that finds no victim) becomes such a recompute:
        a prefill of ``input + decoded`` tokens that waits for space ahead of new prompts.
        Returns False when the job was parked in the wait queue.
        """
        layers = j.exit - j.entry
        cap = self.kv_capacity
        if not j.is_prompt and j.qid in self.kv_held and j.qid not in self.kv_evicted:
            while self.kv_used + layers > cap:
                if not self._preempt_one(exclude=j.qid):
                    break
            if self.kv_used + layers <= cap:
                self.kv_used += layers
                self.kv_held[j.qid] += layers
                return True
            self._evict(j.qid)  # no victim: this session itself gives way
        if j.is_prompt:
            need = j.input_len * layers
        else:
            self.kv_evicted.discard(j.qid)
            ctx = j.input_len + j.decoded
            j.recompute = True
            j.tokens = ctx
            self.recomputes += 1
            need = ctx * layers
        if (not self.kv_wait and self.kv_used + need <= cap) or (not self.kv_held and not self.kv_wait):
            self.kv_used += need
            self.kv_held[j.qid] = need
            return True
        if j.recompute:
            self.kv_wait.insert(0, j)  # vLLM puts preempted sequences before new ones
        else:
            self.kv_wait.append(j)
        self.kv_waits += 1
        return False

    def _preempt_one(self, exclude: int) -> bool:
        """Drop the most recently admitted session's entries (one not inside the node)."""
        inside = self._inside_ids()
        for qid in reversed(self.kv_held):
            if qid != exclude and qid not in inside:
                self._evict(qid)
                return True
        return False

    def _evict(self, qid: int) -> None:
        self.kv_used -= self.kv_held.pop(qid)
        self.kv_evicted.add(qid)
        self.preemptions += 1

    def _inside_ids(self) -> set[int]:
        ids = {j.qid for q in self.pq for j in q}
        ids.update(j.qid for q in self.dq for j in q)
        ids.update(j.qid for j in self._running)
        return ids

    def release(self, query: Query) -> None:
        """``query`` finished: free its KV entries and admit waiting jobs that now fit."""
        self.kv_evicted.discard(query.qid)
        need = self.kv_held.pop(query.qid, 0)
        if not need:
            return
        self.kv_used -= need
        wait = self.kv_wait
        admitted = 0
        vllm = self.kv_mode == "vllm"
        while wait:
            j = wait[0]
            layers = j.exit - j.entry
            if vllm:
                need = (j.tokens if j.recompute else j.input_len) * layers
            else:
                need = (j.input_len + j.output_len) * layers
            if self.kv_used + need > self.kv_capacity and self.kv_held:
                break
            wait.pop(0)
            self.kv_used += need
            self.kv_held[j.qid] = need
            (self.pq if j.is_prompt or j.recompute else self.dq)[j.entry - self.start].append(j)
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
        """Start the next batch, on the next non-empty layer after the one just served."""
        li = self._next_layer()
        if li < 0:
            self.busy = False
            return
        self.busy = True
        self.ptr = li
        layer = self.start + li
        max_req, max_tok, max_dec = self._limits(li)
        bp, ptok, entering = self._take_prompts(li, layer, max_req, max_tok)
        if self.policy.chunk_prefill and ptok < max_tok and len(bp) < max_req:
            # chunked prefill: the next prompt's first tokens fill the budget; it stays queued here
            q = self.pq[li]
            if q:
                j = q[0]
                take = min(max_tok - ptok, j.tokens - j.chunk_done - 1)
                if take > 0:
                    j.chunk_done += take
                    ptok += take
                    if j.entry == layer:
                        entering += take
        bd = self._take_decodes(li, max_dec)
        nd = sum(j.tokens for j in bd) if self.multi_token else len(bd)
        for j in bd:
            if j.entry == layer:
                entering += j.tokens
        p = self._p
        dt = p[ptok] if ptok < len(p) else self.latency.prompt(ptok)
        if nd:
            d = self._d
            t = d[nd] if nd < len(d) else self.latency.decode(nd)
            dt += t + t if nd == 1 else t
        dt += entering * self.overhead
        self.busy_time += dt
        self.batches += 1
        self.prompt_tokens_run += ptok
        self.work_ema = 0.99 * self.work_ema + ptok + nd
        self.time_ema = 0.99 * self.time_ema + dt
        if self.kv_mode == "vllm":
            self._running = bp + bd
        self.loop.after(dt, self._done, (li, bp, bd))

    def _next_layer(self) -> int:
        """The first non-empty local layer queue after ``ptr`` (round-robin), or -1 if none."""
        k = self.k
        pq, dq = self.pq, self.dq
        li = self.ptr
        for _ in range(k):
            li += 1
            if li == k:
                li = 0
            if pq[li] or dq[li]:
                return li
        return -1

    def _limits(self, li: int) -> tuple[int, int, int]:
        """Prompt requests, prompt tokens and decode tokens the batch at local layer ``li`` may take."""
        caps = self.caps
        if not self.policy.dynamic:
            return caps.prompt_max_requests, caps.prompt_max_tokens, caps.decode_max_tokens
        waiting = sum(j.tokens - j.chunk_done for j in self.pq[li])
        free = self.kv_free(self.idx) if self.kv_free is not None else 1.0
        depth = self.depth_sum / self.running_decodes if self.running_decodes else 1.0
        return self.policy.limits(caps, waiting, free, self.running_decodes, depth)

    def _take_prompts(self, li: int, layer: int, max_req: int, max_tok: int) -> tuple[list[Query], int, int]:
        """Prompts FIFO while under both caps: (batch, its tokens, tokens entering the node here).

        The head always goes: a lone prompt larger than the token cap would otherwise block the
        queue forever.
        """
        q = self.pq[li]
        if not q:
            return [], 0, 0
        n = ptok = entering = 0
        chunked = self.policy.chunk_prefill
        for j in q:
            rest = j.tokens - j.chunk_done  # a chunked prompt's tokens not yet through this layer
            if n and (n >= max_req or ptok + rest > max_tok):
                break
            if chunked and not n and rest > max_tok:
                break  # the head does not fit whole: the caller takes a chunk of it
            n += 1
            ptok += rest
            if j.entry == layer:
                entering += rest
            j.chunk_done = 0
        if n == len(q):
            self.pq[li] = []
            return q, ptok, entering
        bp = q[:n]
        del q[:n]
        return bp, ptok, entering

    def _take_decodes(self, li: int, max_dec: int) -> list[Query]:
        """Decodes FIFO up to the decode cap (in tokens: a verify job counts its k + 1)."""
        q = self.dq[li]
        if self.multi_token:
            n = tok = 0
            for j in q:
                if n and tok + j.tokens > max_dec:
                    break
                n, tok = n + 1, tok + j.tokens
            max_dec = n
        if len(q) <= max_dec:
            self.dq[li] = []
            return q
        bd = q[:max_dec]
        del q[:max_dec]
        return bd

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
            if self.recomputes:
                for j in out:
                    if j.recompute:  # context rebuilt; only the new token travels on
                        j.recompute = False
                        j.tokens = 1
            self.on_exit(self, out)
        self._next()
