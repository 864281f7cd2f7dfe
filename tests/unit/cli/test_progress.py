"""The peer's progress display: what it says, when it repeats itself, terminal vs log lines."""

from __future__ import annotations

import asyncio
import io
import logging

from p2pserve.cli.progress import Heartbeat, Progress, describe


def test_describe_says_what_a_plan_driven_peer_waits_for():
    assert describe("joining", None, False, None) == ("waiting for the coordinator's plan to assign layers", True)
    assert describe("loading", (0, 4), False, None) == ("loading layers [0, 4)", True)
    assert describe("loading", (2, 6), False, (0, 4))[0] == "loading layers [2, 6) (serving [0, 4) meanwhile)"
    assert describe("loading", (2, 6), True, (0, 4)) == ("waiting for the handover: layers [2, 6) are loaded", True)
    assert describe("serving", None, False, (0, 4)) == ("serving layers [0, 4)", False)
    assert describe("draining", None, False, None) == ("draining", False)


def test_heartbeat_repeats_a_wait_but_says_a_steady_state_once():
    beat = Heartbeat(every_s=10.0)
    assert beat.update("waiting", 0.0) == "waiting"
    assert beat.update("waiting", 5.0) is None
    assert beat.update("waiting", 10.0) == "still waiting (10 s)"
    assert beat.update("waiting", 15.0) is None
    assert beat.update("serving", 21.5, waiting=False) == "serving (after 21.5 s waiting)"
    assert beat.update("serving", 100.0, waiting=False) is None


class Clock:
    def __init__(self, step: float):
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def test_off_a_terminal_a_step_is_two_log_lines_with_the_duration(caplog):
    out = io.StringIO()
    progress = Progress(out, clock=Clock(2.5))
    assert not progress.interactive  # a StringIO is no TTY
    with caplog.at_level(logging.INFO, logger="p2pserve.peer.progress"):
        with progress.step("profiling cpu"):
            pass
    assert [r.getMessage() for r in caplog.records] == ["profiling cpu...", "profiling cpu: done in 2.5 s"]
    assert out.getvalue() == ""


def test_on_a_terminal_a_step_is_a_tqdm_line(caplog):
    out = io.StringIO()
    with caplog.at_level(logging.INFO, logger="p2pserve.peer.progress"):
        with Progress(out, interactive=True, clock=Clock(1.0)).step("loading layers 0:4"):
            pass
    assert "loading layers 0:4: done in 1.0 s" in out.getvalue()
    assert not caplog.records


def test_follow_logs_changes_and_heartbeats_until_cancelled(caplog):
    states = iter([("waiting for the plan", True)] * 4 + [("serving layers [0, 4)", False)] * 50)

    async def go():
        progress = Progress(io.StringIO(), heartbeat_s=2.0, clock=Clock(1.0))
        task = asyncio.create_task(progress.follow(lambda: next(states), period=0.0))
        for _ in range(10):
            await asyncio.sleep(0)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="p2pserve.peer.progress"):
        asyncio.run(go())
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "waiting for the plan"
    assert "still waiting for the plan (2 s)" in lines
    assert lines[-1] == "serving layers [0, 4) (after 4.0 s waiting for the plan)"
