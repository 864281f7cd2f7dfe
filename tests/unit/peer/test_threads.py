"""Compute threads: the peer's main thread keeps one intra-op thread, its compute threads take
the configured count (``peer/threads.py``). Run in a fresh interpreter: the thread counts are
process state."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import threading, torch
from p2pserve.peer.threads import adopt_torch_threads, compute_threads, set_compute_threads
set_compute_threads(2)
main_team = torch.get_num_threads()
seen = []
t = threading.Thread(target=lambda: seen.append((adopt_torch_threads(), torch.get_num_threads())))
t.start(); t.join()
print(main_team, compute_threads(), seen[0][0], seen[0][1])
"""


def test_main_keeps_one_thread_and_compute_threads_take_the_count():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), check=True)
    assert out.stdout.split() == ["1", "2", "2", "2"]
