"""A Forward handed to the compute worker (:class:`Job`), the result it ends with, and how that
result gets back to the event loop that awaits it (``resolve``: on the loop's own thread)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from p2pserve.errors import P2PServeError
from p2pserve.peer.sampling import Ask, answer
from p2pserve.peer.sessions import Session


@dataclass
class Job:
    """A Forward to run: ``inputs`` are token ids [n] or hidden states [n, H]."""

    session: Session
    inputs: torch.Tensor
    position: int
    sample: bool  # span ends at the last layer: return a sampled token
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    outputs: list = field(default_factory=list)
    loop_thread: int = field(default_factory=threading.get_ident)  # the thread running ``loop``
    # Called on the loop's thread once the worker is done with this job, whether or not the
    # future is still awaited (``SessionTable.settle``: the session may take its next Forward).
    on_settled: Callable[["Job"], None] | None = None
    abandoned: bool = False  # nobody awaits the result any more (the handler timed out): skip it
    # With ``sample``: how many trailing positions get a next token (``Forward.outputs``); above 1
    # the result is a list of tokens, and ``logits`` collects their rows [r, V] chunk by chunk.
    logit_rows: int = 1
    logits: list = field(default_factory=list)
    ask: Ask | None = None  # what the answer needs beyond a plain token (peer/sampling.py): a Choice
    loops: bool = False  # the session's next step follows at once (a ring looping on this peer)


def logit_rows(job: Job, offset: int, n: int, total: int) -> int:
    """How many of a chunk's rows [offset, offset + n) of a job of ``total`` rows are among the
    last ``job.logit_rows`` (whose next tokens the job returns); 0 for a job that samples nothing."""
    if not job.sample:
        return 0
    return max(0, min(n, offset + n - (total - job.logit_rows)))


def finish(job: Job, out: torch.Tensor, position: int) -> "Delivery":
    """The result of a job whose last chunk ran: a sampled token for the token at ``position``
    (the span ends at the last layer), the ``logit_rows`` tokens up to it, or the hidden states
    of all its chunks."""
    if not job.sample:
        return job, (job.outputs[0] if len(job.outputs) == 1 else torch.cat(job.outputs)), None
    try:
        return job, answer(job.logits if job.logit_rows > 1 else [out], job.logit_rows, job.session.sampling,
                           position, job.ask), None
    except P2PServeError as e:
        job.session.cache.truncate(job.position)
        return job, None, e


#: A finished job and its result: (job, value, exception).
Delivery = tuple["Job", object, "BaseException | None"]


def deliver_all(done: list[Delivery]) -> None:
    """Resolve every finished job's future with its value or exception: a step's jobs of one
    event loop in one callback there, so their handlers all go on in the same turn of the loop
    (a batch link then sends their next steps on as one frame, ``peer/batch_link.py``)."""
    by_loop: dict[int, list[Delivery]] = {}
    for d in done:
        by_loop.setdefault(id(d[0].loop), []).append(d)
    for group in by_loop.values():
        _on_loop(group[0][0], lambda group=group: [_settle(*d) for d in group])


def resolve(job: Job, value=None, exc: BaseException | None = None) -> None:
    """Settle ``job`` and resolve its future on the event loop's thread (a no-op once the loop is gone)."""
    _on_loop(job, lambda: _settle(job, value, exc))


def _settle(job: Job, value, exc: BaseException | None) -> None:
    if job.on_settled is not None:
        job.on_settled(job)
    if job.future.done():  # cancelled: its handler timed out or went away
        return
    if exc is not None:
        job.future.set_exception(exc)
    else:
        job.future.set_result(value)


def _on_loop(job: Job, deliver) -> None:
    """Run ``deliver`` on ``job``'s event loop thread: inline when called there."""
    if threading.get_ident() == job.loop_thread:
        deliver()
        return
    try:
        job.loop.call_soon_threadsafe(deliver)
    except RuntimeError:  # loop already closed during shutdown
        pass
