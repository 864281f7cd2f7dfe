"""Children that do not outlive the process that launched them.

``p2pserve.launch`` starts every peer, coordinator and bootstrap node of the demo, the tests and
the benchmarks in its own process group and names itself in ``P2PSERVE_PARENT_PID``. A child
that finds its own parent there watches it and, once it is gone (killed by a test timeout, or
by Ctrl-C on a benchmark), stops its whole group: itself, its DHT process and its libp2p daemon.
Before, such children ran on as orphans and took CPU from whatever ran next. A process started
by hand (``p2pserve peer`` from a shell, under systemd or nohup) has no such variable and is
never stopped this way.

Whoever starts a process, the processes p2pserve starts for it die with it too
(:func:`children_die_with_us`, :func:`end_with_parent`): a libp2p daemon gets the parent-death
signal (``PR_SET_PDEATHSIG``, Linux) and a DHT process watches its parent. So a peer, a
coordinator or a client program that is SIGKILLed (the OOM killer, a crash, ``os._exit``) leaves
neither its DHT process nor its ``p2pd`` running.
"""

from __future__ import annotations

import asyncio.subprocess
import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterator

_PR_SET_PDEATHSIG = 1
# looked up before any fork: a child runs only the prctl call between fork and exec
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None

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


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when the thread that started it ends
    (``PR_SET_PDEATHSIG``; nothing off Linux). Meant for ``preexec_fn``: it runs in the child."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


@contextlib.contextmanager
def children_die_with_us() -> Iterator[None]:
    """Subprocesses started with asyncio meanwhile (hivemind's ``p2pd``) get the parent-death
    signal: they die when the thread that started them does (call it from a thread that lives as
    long as they should: the event loop's)."""
    original = asyncio.subprocess.create_subprocess_exec

    async def exec_dying_with_us(*args, **kwargs):
        kwargs.setdefault("preexec_fn", die_with_parent)
        return await original(*args, **kwargs)

    asyncio.subprocess.create_subprocess_exec = exec_dying_with_us
    try:
        yield
    finally:
        asyncio.subprocess.create_subprocess_exec = original


def child_pids(pid: int) -> list[int]:
    """The live children of ``pid`` (from ``/proc``; none where there is no ``/proc``)."""
    out = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def end_with_parent(interval_s: float = 0.5) -> threading.Thread:
    """In a helper process (a DHT node's): once the process that started it is gone, kill this
    process's own children and exit at once, as nothing is left to serve."""
    def gone() -> None:
        for pid in child_pids(os.getpid()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os._exit(0)

    return watch_parent(os.getppid(), gone, interval_s)
