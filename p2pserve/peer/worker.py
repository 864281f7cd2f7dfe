"""The compute thread: one per device, running continuous batches over all sessions.

The asyncio loop submits jobs and awaits futures; this thread repeatedly asks the
``TokenThrottle`` for the next step's chunks, runs them through the shard in one batch, and
resolves futures when a job's last chunk is done. Network I/O never waits on compute and
compute never waits on I/O.

One exception, for latency: ``run_inline`` runs a job on the caller's (I/O) thread when the
worker is idle. The handler uses it for a single decode token of a session that has been alone
on the peer for a while; that saves the wake-up of this thread and of the loop (~0.2 ms a hop)
and costs nothing, since there is nobody to batch with. Either way one step runs at a time
(``_busy``), so the shard and the KV caches never see two steps at once. Not on a CPU peer with
more than one torch thread: there the I/O thread's steps ran on one core (SmolLM2, whole model,
2 threads: 47 ms a token inline against 27 ms on the compute thread, which applies the thread
count, ``peer/threads.py``; at 1 thread both took 47-48 ms).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from p2pserve.errors import OverloadedError, P2PServeError, RangeMovedError, RequestError, SessionNotFoundError
from p2pserve.model.shard import Segment, Shard
from p2pserve.peer.batch_forming import ArrivalForecast
from p2pserve.peer.batcher import Pending, TokenThrottle
from p2pserve.peer.job import Delivery, Job, deliver_all, finish, logit_rows, resolve
from p2pserve.peer.kv_cache import KVBudget
from p2pserve.peer.threads import adopt_torch_threads, compute_threads
from p2pserve.peer.timing import RecentTimes

log = logging.getLogger(__name__)

#: The longest a step waits for a batch being handed over (``hold_next_step``): the hand-over
#: takes one event-loop turn, so this bounds only a caller that never released.
MAX_HOLD_S = 0.05


@dataclass
class WorkerStats:
    """Counters for status and benchmarks."""

    steps: int = 0
    tokens: int = 0
    max_batch_tokens: int = 0
    max_batch_sessions: int = 0
    inline_steps: int = 0
    compute: RecentTimes = field(default_factory=RecentTimes)  # recent steps' shard time


class ComputeWorker:
    """Owns the shard and runs batches on a dedicated thread."""

    def __init__(self, shard: Shard | None, throttle: TokenThrottle, budget: KVBudget, metrics=None):
        self.shard: Shard | None = None
        self.throttle = throttle
        self._serve(shard)
        self.budget = budget
        self.stats = WorkerStats()
        self._cv = threading.Condition()
        self._incoming: list[Job] = []
        self._waiting: list[Pending] = []
        self._tickets = itertools.count()
        self.forecast = ArrivalForecast()  # when sessions' next Forwards are due (batch forming)
        # looping sessions (a ring on this peer alone) whose next step is on its way: session id
        # -> until when the next batch waits for it (``_form_batch``)
        self._returning: dict[str, float] = {}
        self._holds = 0  # callers handing the worker a batch of jobs (``hold_next_step``)
        self._held_since = 0.0  # when the first of them began
        self._stop = False
        self._busy = False  # a step is running (on this thread or inline on the caller's)
        self._step_since: float | None = None  # time.monotonic() when the running step began
        self.restarts = 0  # compute threads started again by ``revive``
        self.metrics = metrics  # a p2pserve.metrics.PeerMetrics when the peer exports metrics
        self._thread = self._new_thread()

    def _new_thread(self) -> threading.Thread:
        return threading.Thread(target=self._run, name="p2pserve-compute", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------------ watchdog
    @property
    def alive(self) -> bool:
        """Whether the compute thread is running (it is started by ``start``)."""
        return self._thread.is_alive()

    def stuck_for(self, now: float | None = None) -> float:
        """Seconds the running step has taken so far (0 when no step runs)."""
        since = self._step_since
        return 0.0 if since is None else (time.monotonic() if now is None else now) - since

    def revive(self) -> bool:
        """Start a new compute thread if the current one ended without ``stop``; True if it did.

        The thread catches every ``Exception`` of a step, so this is the last line: something
        that still ends it (a ``BaseException`` from a library, a bug in the loop itself) must not
        leave a peer that answers stats and announces but never computes. Jobs that waited on
        the dead thread fail with a retriable error; their clients replay elsewhere.
        """
        with self._cv:
            if self._stop or self._thread.is_alive() or self._thread.ident is None:
                return False
            done = self._fail_waiting(RequestError("the peer's compute thread was restarted; retry"))
            for job in self._incoming:
                done.append((job, None, RequestError("the peer's compute thread was restarted; retry")))
            self._incoming.clear()
            self._busy, self._step_since = False, None
            self._thread = self._new_thread()
            self._thread.start()
            self.restarts += 1
        deliver_all(done)
        return True

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=10)

    @property
    def queued_jobs(self) -> int:
        """Forwards submitted and not yet finished (the queue depth)."""
        return len(self._waiting) + len(self._incoming)

    @property
    def queued_tokens(self) -> int:
        """Tokens waiting to run (announced as live load)."""
        return sum(p.remaining for p in self._waiting) + sum(j.inputs.shape[0] for j in self._incoming)

    def replace_shard(self, shard: Shard) -> None:
        """Use a newly loaded shard from the next step on (the running step keeps the old one)."""
        with self._cv:
            self._serve(shard)

    def _serve(self, shard: Shard | None) -> None:
        """Step ``shard`` from now on; the throttle learns whether it holds every layer (a stage
        of several peers steps its sessions in micro-batches: ``BatchingConfig.depth``)."""
        self.shard = shard
        if shard is not None:
            self.throttle.whole_model = shard.start == 0 and shard.end == shard.spec.num_layers

    def submit(self, job: Job) -> None:
        """Queue a job; its future resolves with hidden states [n, H] or a token id."""
        with self._cv:
            self._incoming.append(job)
            self.forecast.arrived(job.session.id, job.session, time.monotonic())
            self._cv.notify()

    def hold_next_step(self) -> Callable[[], None]:
        """Keep the next step from starting (at most ``MAX_HOLD_S``) until the returned release
        is called: the jobs submitted meanwhile (one batch of ring steps from the previous peer,
        ``peer/batch_link.py``) then run in one step, not split by a step begun on the first."""
        with self._cv:
            if self._holds == 0:
                self._held_since = time.monotonic()
            self._holds += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                with self._cv:
                    self._holds -= 1
                    self._cv.notify()

        return release

    def run_inline(self, job: Job) -> bool:
        """Run ``job`` to completion on the calling thread if nothing else is queued or running.

        Returns False (and does nothing) otherwise; the caller then ``submit``s it. The job's
        future is resolved as usual.
        """
        with self._cv:
            if self._busy or self._stop or self._incoming or self._waiting or self.shard is None:
                return False
            if self.shard.device.type == "cpu" and compute_threads() > 1:
                return False  # see the module docstring: multi-threaded CPU steps run on the thread
            self._busy, self._step_since = True, time.monotonic()
            self.forecast.arrived(job.session.id, job.session, self._step_since)
            pending = self._pending(job)
            self._waiting.append(pending)
        done: list[Delivery] = []
        try:
            while any(p is pending for p in self._waiting):
                done += self._step()
                self.stats.inline_steps += 1
        finally:
            with self._cv:
                self._busy, self._step_since = False, None
                self._cv.notify()  # jobs submitted meanwhile wait for the thread
            deliver_all(done)
        return True

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        adopt_torch_threads()
        if self.shard is not None:  # compiled once here, with this thread's team, before serving
            self.shard.warm()
        while True:
            with self._cv:
                while not self._stop and (self._busy or (not self._incoming and not self._waiting)):
                    self._cv.wait()
                if self._stop:
                    break
                self._form_batch()
                if self._stop:
                    break
                self._busy, self._step_since = True, time.monotonic()
            done: list[Delivery] = []
            try:
                done = self._step()
            except Exception as e:  # a bug in one step must not end the thread: fail what waits
                log.exception("compute step failed")
                done = self._fail_waiting(RequestError(f"compute failed: {type(e).__name__}: {e}"))
            finally:
                # Idle before the results go out: the session's next frame can arrive as soon as
                # its reply does, and a worker still "busy" then refuses ``run_inline``, so a lone
                # session's next decode would take the thread handoff again
                # (tests/unit/peer/test_peer_inline.py).
                with self._cv:
                    self._busy, self._step_since = False, None
                    self._expect_returns(done)
                deliver_all(done)
        for p in self._waiting:
            resolve(p.key, exc=RequestError("peer is shutting down"))

    def _take_incoming(self) -> None:
        self._waiting.extend(self._pending(job) for job in self._incoming)
        self._incoming.clear()

    def _pending(self, job: Job) -> Pending:
        """``job`` as the batcher's queue entry: its rows, a FIFO ticket and whether it is
        background work (a witness replay, run only in spare steps)."""
        return Pending(job, job.inputs.shape[0], next(self._tickets), background=job.session.background)

    def loop_ended(self, session_id: str) -> None:
        """A looping session will not come back with a next step now (its ring paused, stopped or
        failed): the next batch does not wait for it."""
        with self._cv:
            if self._returning.pop(session_id, None) is not None:
                self._cv.notify()

    def _expect_returns(self, done: list[Delivery]) -> None:
        """Looping sessions that just got their token come straight back with the next step:
        the next batch waits for them until they are all in (or told not to come,
        :meth:`loop_ended`), at most about a step's compute (at least 20 ms, at most 200), so
        sessions that loop on this peer keep stepping together in one batch rather than drifting
        into many small ones as each is handed back through the event loop."""
        wait = min(0.2, max(0.02, self.stats.compute.median_ms / 1000))
        until = time.monotonic() + wait
        for job, _, exc in done:
            if job.loops and exc is None:
                self._returning[job.session.id] = until

    def _loop_hold(self, now: float) -> float:
        """Seconds the next batch still waits for looping sessions on their way back."""
        for sid in [sid for sid, until in self._returning.items() if until <= now]:
            del self._returning[sid]
        return max(self._returning.values(), default=now) - now

    def _form_batch(self) -> None:
        """Queue what was submitted, holding the step (lock released while waiting) for the
        sessions due within about one step's compute time (peer/batch_forming.py), and for the
        looping sessions on their way back (``_expect_returns``)."""
        ready = time.monotonic()
        horizon = min(self.throttle.config.max_batch_wait_s, self.stats.compute.median_ms / 1000)
        while True:
            self._take_incoming()
            for p in self._waiting:
                self._returning.pop(p.key.session.id, None)
            hold = self.forecast.hold_s({p.key.session.id for p in self._waiting}, ready, now := time.monotonic(), horizon)
            hold = max(hold, self._loop_hold(now))
            if self._holds > 0:  # a batch is being handed over (``hold_next_step``)
                hold = max(hold, self._held_since + MAX_HOLD_S - now)
            if hold <= 0 or self._stop or self.throttle.micro_batch_full(
                    sum(p.is_decode for p in self._waiting), self._running(now)):
                return
            self._cv.wait(hold)

    def _running(self, now: float) -> int | None:
        """gLLM's #RD: sessions decoding through this peer lately (None at depth 1: not needed)."""
        return self.forecast.active(now) if self.throttle.depth > 1 else None

    def _fail_waiting(self, err: BaseException) -> list[Delivery]:
        """Fail every waiting job, dropping positions they may have half written."""
        done: list[Delivery] = []
        for p in list(self._waiting):
            job: Job = p.key
            job.session.cache.truncate(job.position)
            done.append((job, None, err))
        self._waiting.clear()
        return done

    def _step(self) -> list[Delivery]:
        """One batched forward over the waiting jobs; returns the results for the caller to
        deliver once the worker is idle again."""
        done: list[Delivery] = []
        shard = self.shard
        moved = [p for p in self._waiting
                 if shard is None or not (shard.start <= p.key.session.start and p.key.session.end <= shard.end)]
        for p in moved:  # the peer flipped to another range while these waited
            self._waiting.remove(p)
            done.append((p.key, None, RangeMovedError("this peer moved to another layer range; replay elsewhere")))
        done += self._drop_unwanted()
        if not self._waiting:
            return done
        chunks = self.throttle.schedule(self._waiting, self.budget.free_fraction, self._running(time.monotonic()))
        segments = []
        for ch in chunks:
            job: Job = ch.pending.key
            rows = logit_rows(job, ch.offset, ch.n, ch.pending.total)
            segments.append(
                Segment(
                    inputs=job.inputs[ch.offset : ch.offset + ch.n],
                    position=job.position + ch.offset,
                    start=job.session.start,
                    end=job.session.end,
                    cache=job.session.cache,
                    want_logits=rows > 0,
                    logit_rows=max(rows, 1),
                    rope_end=job.position + ch.pending.total,  # length-dependent rotary: the whole Forward's
                )
            )
        t0 = time.perf_counter()
        try:
            outputs: list = shard.forward_batch(segments)
        except Exception:  # one bad job must not fail the honest ones batched with it
            log.warning("batch of %d failed; re-running its chunks one by one", len(chunks), exc_info=True)
            outputs = self._forward_each(shard, chunks, segments)
        st = self.stats
        elapsed = time.perf_counter() - t0
        st.compute.add(elapsed)
        n_tokens = sum(c.n for c in chunks)
        if self.metrics is not None:
            self.metrics.step(n_tokens, len(chunks), elapsed)
        st.steps += 1
        st.tokens += n_tokens
        st.max_batch_tokens = max(st.max_batch_tokens, n_tokens)
        st.max_batch_sessions = max(st.max_batch_sessions, len(chunks))
        for ch, seg, out in zip(chunks, segments, outputs):
            job = ch.pending.key
            if isinstance(out, BaseException):
                self._waiting.remove(ch.pending)
                done.append((job, None, out))
                continue
            (job.logits if seg.want_logits and job.logit_rows > 1 else job.outputs).append(out)
            note = getattr(seg.cache, "note_written", None)
            if note is not None:  # share the full blocks it filled with sessions of the same prefix
                note(seg.inputs, seg.position)
            if ch.pending.advance(ch.n):
                self._waiting.remove(ch.pending)
                done.append(finish(job, out, job.position + ch.pending.total))
        return done

    def _drop_unwanted(self) -> list[Delivery]:
        """Drop waiting jobs whose session was closed or whose handler gave up on them: running
        them would only write into a cache nobody reads (a closed session's reservation is
        already promised back, see ``SessionTable.settle``)."""
        done: list[Delivery] = []
        for p in [p for p in self._waiting if p.key.session.closed or p.key.abandoned]:
            self._waiting.remove(p)
            job: Job = p.key
            if job.session.closed:
                done.append((job, None, SessionNotFoundError(f"session {job.session.id!r} was closed")))
            else:  # a chunked prefill may have written part of its positions
                job.session.cache.truncate(job.position)
                done.append((job, None, OverloadedError("the request timed out in this peer's queue")))
        return done

    def _forward_each(self, shard: Shard, chunks: list, segments: list[Segment]) -> list:
        """Run each chunk alone after its batch failed: an output per chunk, or the error that
        chunk's job fails with (its half-written positions dropped first)."""
        outputs: list = []
        for ch, seg in zip(chunks, segments):
            job: Job = ch.pending.key
            job.session.cache.truncate(job.position + ch.offset)  # the failed batch may have written some
            try:
                outputs.append(shard.forward_batch([seg])[0])
            except Exception as e:
                log.info("job of session %s failed alone: %s: %s", job.session.id, type(e).__name__, e)
                job.session.cache.truncate(job.position)
                outputs.append(e if isinstance(e, P2PServeError)
                               else RequestError(f"compute failed: {type(e).__name__}: {e}"))
        return outputs
