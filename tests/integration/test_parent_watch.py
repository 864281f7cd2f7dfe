"""A child started by ``p2pserve.launch`` stops with its launcher (``p2pserve/parent_watch.py``).

A launcher process starts a real bootstrap node (its own process group, with its libp2p
daemon) through ``Children.start`` and is then SIGKILLed, as a test timeout or a killed
benchmark would leave it: the node must not run on as an orphan.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

LAUNCHER = """
import sys, time
from pathlib import Path
from p2pserve.launch import Children
work = Path(sys.argv[1])
child = Children(work).start("boot", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                             "--maddrs-file", str(work / "boot.maddrs"))
print(child.proc.pid, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has stopped; whoever adopted it reaps it


def test_a_launched_child_stops_when_its_launcher_is_killed(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    try:
        child = int(launcher.stdout.readline())
        deadline = time.monotonic() + 60
        while not (tmp_path / "boot.maddrs").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _running(child), "the bootstrap node did not start"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + 30
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _running(child), "the child outlived its launcher"
    finally:
        launcher.kill()
        try:
            os.killpg(child, signal.SIGKILL)
        except (ProcessLookupError, NameError, UnboundLocalError):
            pass


def test_a_process_started_by_hand_is_not_watched(monkeypatch):
    from p2pserve.parent_watch import PARENT_ENV, exit_with_launcher

    monkeypatch.delenv(PARENT_ENV, raising=False)
    assert not exit_with_launcher()
    monkeypatch.setenv(PARENT_ENV, str(os.getppid() + 1))  # someone else
    assert not exit_with_launcher()
