"""`p2pserve demo` end to end on a tiny model, and Ctrl-C leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.integration


def demo(model: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "p2pserve.cli", "demo", "--model", model, "--peers", "2", "--max-new-tokens", "8", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def children_of(logdir: str) -> list[str]:
    """Command lines of live processes that mention the demo's log directory."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if logdir in cmd:
            found.append(cmd)
    return found


def test_demo_answers_and_stops_everything(model_dir):
    p = demo(model_dir("llama"))
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    assert "route: client ->" in out and "all demo processes stopped" in out
    logdir = next(line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("logs: "))
    assert children_of(logdir) == []


def test_interrupted_demo_leaves_no_stray_processes(model_dir):
    p = demo(model_dir("llama"))
    logdir = None
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("logs: "):
            logdir = line.split(" ", 1)[1].strip()
        if line.startswith("[3/5]"):
            break
    assert logdir, "".join(lines)
    time.sleep(3)  # children are starting
    assert children_of(logdir), "the demo should have started its swarm"
    p.send_signal(signal.SIGINT)
    rest, _ = p.communicate(timeout=60)
    assert "all demo processes stopped" in rest, rest
    time.sleep(1)
    assert children_of(logdir) == []
