"""Torch intra-op threads in the peer's own threads.

``torch.set_num_threads`` on the main thread sets the process-wide count, but with OpenMP each
thread keeps its own team size, which a thread started later takes from ``OMP_NUM_THREADS``
when that is set. A peer started with ``OMP_NUM_THREADS=1 p2pserve peer --num-threads 2`` (as
``p2pserve.launch`` starts them) computed on one core: its compute thread and its profiling
thread ran at 1 thread while ``torch.get_num_threads()`` said 2. Each such thread calls
:func:`adopt_torch_threads` first.

Only those threads compute with several: the peer's main thread (the event loop, and where the
weights load) keeps one (:func:`set_compute_threads`). An OpenMP team of the main thread, made
by its first parallel op, slows every later team of another thread on the same cores: a bf16
576x1536 projection of one row took 119 us on a compute thread when the main thread had
computed with two threads before, and 61 us when it had not (the same as on the main thread),
with 2 threads on this 2-core machine.
"""

from __future__ import annotations

import torch


_compute_threads: int | None = None  # set once by the peer at start (set_compute_threads)


def set_compute_threads(n: int) -> None:
    """The peer computes with ``n`` intra-op threads on its compute threads; the calling (main)
    thread keeps one from now on (module docstring)."""
    global _compute_threads
    _compute_threads = max(1, n)
    torch.set_num_threads(1)


def compute_threads() -> int:
    """The intra-op threads of a compute thread: as set by :func:`set_compute_threads`, else the
    process's torch thread count."""
    return _compute_threads if _compute_threads is not None else torch.get_num_threads()


def adopt_torch_threads() -> int:
    """Apply the compute thread count to the calling thread; returns it."""
    n = compute_threads()
    torch.set_num_threads(n)  # sets this thread's OpenMP team size too
    return n
