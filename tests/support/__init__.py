"""Helpers shared by the tests (never in a ``test_*.py``): :func:`wait_for` here, and builders by
concept in the submodules (``sim``, ``planner``, ``failover``, ``wire``, ``swarm``)."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import pytest

DEADLINE = 60.0  # generous: seconds on a loaded 2-core machine, not a performance claim


def wait_for(check: Callable[[], Any], what: str, timeout: float = DEADLINE, interval: float = 0.3,
             children: Optional[Any] = None, explain: Optional[Callable[[], str]] = None) -> Any:
    """Poll ``check()`` (sync, may return a value) until it is truthy and return that value; fail
    the test naming ``what`` after ``timeout`` seconds, with ``explain()`` appended when given.
    ``children`` (a ``launch.Children``): one that exited fails the wait at once, with its output."""
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        if children is not None:
            children.check()
        last = check()
        if last:
            return last
        time.sleep(interval)
    detail = f"; {explain()}" if explain is not None else ""
    pytest.fail(f"timed out waiting for {what} (last: {last!r}){detail}")
