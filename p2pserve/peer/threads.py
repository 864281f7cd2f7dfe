"""Torch intra-op threads in the peer's own threads.

``torch.set_num_threads`` on the main thread sets the process-wide count, but with OpenMP each
thread keeps its own team size, which a thread started later takes from ``OMP_NUM_THREADS``
when that is set. A peer started with ``OMP_NUM_THREADS=1 p2pserve peer --num-threads 2`` (as
``p2pserve.launch`` starts them) computed on one core: its compute thread and its profiling
thread ran at 1 thread while ``torch.get_num_threads()`` said 2. Each such thread calls
:func:`adopt_torch_threads` first.
"""

from __future__ import annotations

import torch


def adopt_torch_threads() -> int:
    """Apply the process's torch thread count to the calling thread; returns it."""
    n = torch.get_num_threads()  # the process-wide value set by torch.set_num_threads
    torch.set_num_threads(n)  # sets this thread's OpenMP team size too
    return n
