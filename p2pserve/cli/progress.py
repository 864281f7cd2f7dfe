"""Progress where a peer's operator waits: model conversion, loading, profiling, the plan.

On a terminal each wait is a live tqdm line (what, elapsed time); when stderr is not a TTY (a
service's journal, a log file) it is plain log lines instead: one when a step starts, one when
it ends with its duration, and while waiting for the plan a line every ``heartbeat_s`` saying
what the peer waits for. ``describe`` and ``Heartbeat`` are the pure parts; the rest only draws.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, TextIO

logger = logging.getLogger("p2pserve.peer.progress")


def describe(state: str, loading: Optional[tuple[int, int]], loaded: bool,
             served: Optional[tuple[int, int]]) -> tuple[str, bool]:
    """What a plan-driven peer is doing, from its agent's state: (one line, whether it is
    waiting for something, which earns a heartbeat line, or steady: serving, draining)."""
    def rng(span):
        return f"[{span[0]}, {span[1]})"

    if loading is not None and not loaded:
        return f"loading layers {rng(loading)}" + (f" (serving {rng(served)} meanwhile)" if served else ""), True
    if loading is not None:
        return f"waiting for the handover: layers {rng(loading)} are loaded", True
    if served is not None:
        return f"serving layers {rng(served)}", False
    if state == "draining":
        return "draining", False
    return "waiting for the coordinator's plan to assign layers", True


class Heartbeat:
    """When to print a plain line about a wait: when what it says changes, and every ``every_s``
    while it does not (0 = only on change)."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self.text: Optional[str] = None
        self.since = 0.0  # when ``text`` started
        self._said_at = 0.0

    def update(self, text: str, now: float, waiting: bool = True) -> Optional[str]:
        """The line to print now for ``text`` (None: nothing); a steady state (not ``waiting``)
        is said once."""
        if text != self.text:
            prev, took = self.text, now - self.since
            self.text, self.since, self._said_at = text, now, now
            return text if prev is None else f"{text} (after {took:.1f} s {prev})"
        if waiting and self.every_s > 0 and now - self._said_at >= self.every_s:
            self._said_at = now
            return f"still {text} ({now - self.since:.0f} s)"
        return None


class Progress:
    """The peer command's progress display (``interactive``: a terminal, default from stderr)."""

    def __init__(self, stream: TextIO = sys.stderr, interactive: Optional[bool] = None, heartbeat_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.stream = stream
        self.interactive = stream.isatty() if interactive is None else interactive
        self.heartbeat_s = heartbeat_s
        self.clock = clock

    def _bar(self, desc: str):
        from tqdm import tqdm

        return tqdm(total=None, desc=desc, file=self.stream, bar_format="{desc}: {elapsed}", leave=True)

    @contextmanager
    def step(self, what: str) -> Iterator[None]:
        """A step that runs to its end (``with progress.step("profiling"):``)."""
        t0 = self.clock()
        bar = self._bar(what) if self.interactive else None
        if bar is None:
            logger.info(f"{what}...")
        try:
            yield
        finally:
            took = self.clock() - t0
            if bar is not None:
                bar.set_description_str(f"{what}: done in {took:.1f} s")
                bar.close()
            else:
                logger.info(f"{what}: done in {took:.1f} s")

    async def follow(self, status: Callable[[], tuple[str, bool]], period: float = 1.0) -> None:
        """Show ``status()`` (a line, whether it is a wait: :func:`describe`) until cancelled: a live
        line on a terminal, else a log line on every change and a heartbeat while a wait lasts."""
        beat = Heartbeat(self.heartbeat_s)
        bar = None
        try:
            while True:
                text, waiting = status()
                line = beat.update(text, self.clock(), waiting)
                if self.interactive:
                    if line is not None and not line.startswith("still "):
                        if bar is not None:
                            bar.close()
                        bar = self._bar(text)
                    elif bar is not None:
                        bar.refresh()
                elif line is not None:
                    logger.info(line)
                await asyncio.sleep(period)
        finally:
            if bar is not None:
                bar.close()
