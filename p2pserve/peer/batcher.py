"""Continuous batching with gLLM token throttling: which tokens run in the next step.

Pure logic: ``TokenThrottle.schedule()`` picks work from the waiting queue given the free KV
share; the compute worker runs what it picked and calls ``Pending.advance()``. Decode tokens
(one per session) go first because a whole pipeline is waiting on each of them; prefill is
chunked so a long prompt cannot stall every decode behind it. Background work (a verifier's
witness replay, ``OpenSession.background``) runs only in steps that have no other work, so it never
delays a serving session's step beyond the one background step already running; a background
request passed over ``BatchingConfig.background_max_skips`` times runs anyway (no starvation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from p2pserve import throttle
from p2pserve.config import BatchingConfig


@dataclass
class Pending:
    """One Forward waiting on this peer: ``total`` tokens of which ``done`` have run."""

    key: Any  # opaque handle of the compute worker (its job object)
    total: int
    arrival: int  # monotonically increasing ticket, for FIFO order
    done: int = 0
    background: bool = False  # runs only when nothing else waits (a verifier's witness replay)
    skipped: int = 0  # steps that ran while this background request waited

    @property
    def remaining(self) -> int:
        return self.total - self.done

    @property
    def is_decode(self) -> bool:
        """A single-token request from a session that already has a cache."""
        return self.total == 1

    def advance(self, n: int) -> bool:
        """Record n more tokens run; returns True when the request is complete."""
        self.done += n
        return self.done >= self.total


@dataclass(frozen=True)
class Chunk:
    """Run tokens [offset, offset + n) of a pending request in this step."""

    pending: Pending
    offset: int
    n: int


@dataclass
class TokenThrottle:
    """gLLM token throttling over a FIFO of pending requests. ``whole_model``: the peer holds
    every layer (its worker says so with each shard); the pipeline depth follows from it
    unless configured (``BatchingConfig.depth``)."""

    config: BatchingConfig = field(default_factory=BatchingConfig)
    whole_model: bool = True

    @property
    def depth(self) -> int:
        """The pipeline depth in effect: micro-batches in flight through this peer."""
        return self.config.depth(self.whole_model)

    def prefill_budget(self, waiting_prefill_tokens: int, kv_free_fraction: float) -> int:
        """#P = max(min(#WP/#T, #MaxP·(KVfree−KVthresh)/(1−KVthresh)), #MinP)."""
        c = self.config
        return throttle.prefill_budget(waiting_prefill_tokens, kv_free_fraction, iterations=c.spread_steps(self.depth),
                                       max_prefill=c.max_prefill_tokens, min_prefill=c.min_prefill_tokens,
                                       kv_thresh=c.kv_threshold)

    def decode_budget(self, waiting_decode: int, running: int | None = None) -> int:
        """gLLM's #D = #RD / PP_depth, at least one when any decode waits.

        #RD is every decode session running through this peer (``running``: those seen lately,
        at least the ones waiting here), not only the waiting ones: a depth-d pipeline then
        carries d micro-batches of #RD / d sessions each. Dividing the waiting count instead
        would split every arriving micro-batch again at each stage. Without ``running`` the
        waiting count stands in for it (the same at depth 1)."""
        if waiting_decode == 0:
            return 0
        rd = waiting_decode if running is None else max(running, waiting_decode)
        return throttle.decode_budget(rd, self.depth)

    def micro_batch_full(self, waiting_decode: int, running: int | None) -> bool:
        """Whether a depth > 1 pipeline's micro-batch (#D decodes) waits here already, so
        batch forming need not hold the step for more (at depth 1 forming decides alone)."""
        return self.depth > 1 and waiting_decode >= self.decode_budget(waiting_decode, running)

    def schedule(self, waiting: list[Pending], kv_free_fraction: float, running: int | None = None) -> list[Chunk]:
        """Choose this step's chunks; never returns an empty list when work is waiting.

        Background requests are left out while anything else waits (each one left out counts a
        skip), unless they were skipped ``background_max_skips`` times already.
        """
        if not waiting:
            return []
        limit = self.config.background_max_skips
        urgent = [p for p in waiting if not p.background or p.skipped >= limit]
        if urgent and len(urgent) < len(waiting):
            for p in waiting:
                if p.background and p.skipped < limit:
                    p.skipped += 1
            waiting = urgent
        decodes = [p for p in waiting if p.is_decode]
        prefills = sorted((p for p in waiting if not p.is_decode), key=lambda p: p.arrival)
        cap = self.config.max_batch_tokens
        chosen: list[Chunk] = []
        used = 0
        for p in sorted(decodes, key=lambda p: p.arrival)[: min(self.decode_budget(len(decodes), running), cap)]:
            chosen.append(Chunk(p, p.done, 1))
            used += 1
        waiting_prefill = sum(p.remaining for p in prefills)
        budget = min(self.prefill_budget(waiting_prefill, kv_free_fraction), cap - used)
        for p in prefills:
            if budget <= 0:
                break
            n = min(p.remaining, budget)
            chosen.append(Chunk(p, p.done, n))
            budget -= n
        if not chosen:  # a cap of zero left nothing: make progress on the oldest request
            oldest = min(waiting, key=lambda p: p.arrival)
            chosen.append(Chunk(oldest, oldest.done, min(oldest.remaining, max(1, cap))))
        return chosen
