"""Children that do not outlive the process that launched them.

``p2pserve.launch`` starts every peer, coordinator and bootstrap node of the demo, the tests and
the benchmarks in its own process group and names itself in ``P2PSERVE_PARENT_PID``. A child
that finds its own parent there watches it and, once it is gone (killed by a test timeout, or
by Ctrl-C on a benchmark), stops its whole group: itself, its DHT process and its libp2p daemon.
Before, such children ran on as orphans and took CPU from whatever ran next. A process started
by hand (``p2pserve peer`` from a shell, under systemd or nohup) has no such variable and is
never stopped this way.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

#: The environment variable that names the launching process.
PARENT_ENV = "P2PSERVE_PARENT_PID"


def watch_parent(parent: int, on_gone: Callable[[], None], interval_s: float = 0.5) -> threading.Thread:
    """Call ``on_gone`` (on a daemon thread) once this process's parent is no longer ``parent``
    (a dead parent's children are re-parented)."""

    def loop() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        on_gone()

    thread = threading.Thread(target=loop, name="p2pserve-parent-watch", daemon=True)
    thread.start()
    return thread


def stop_own_group(grace_s: float = 10.0) -> None:
    """SIGTERM this process's group (a graceful stop), then SIGKILL it after ``grace_s``."""
    group = os.getpgid(0)
    os.killpg(group, signal.SIGTERM)
    time.sleep(grace_s)
    os.killpg(group, signal.SIGKILL)


def exit_with_launcher() -> bool:
    """Watch the launcher named in :data:`PARENT_ENV` when it is this process's parent and this
    process leads its own group (as ``p2pserve.launch`` starts children); returns whether it does."""
    named = os.environ.get(PARENT_ENV, "")
    if not named.isdigit() or int(named) != os.getppid() or os.getpgid(0) != os.getpid():
        return False
    watch_parent(int(named), stop_own_group)
    return True
