"""One event loop for every asynchronous property, and a timeout on each example: a decoder
that waits for bytes it will never get fails the property instead of hanging it."""

from __future__ import annotations

import asyncio

_LOOP = asyncio.new_event_loop()


def run(coro, timeout_s: float = 10.0):
    """Run ``coro`` to completion on the shared loop; ``TimeoutError`` if it takes ``timeout_s``."""
    return _LOOP.run_until_complete(asyncio.wait_for(coro, timeout_s))


def reader_of(data: bytes) -> asyncio.StreamReader:
    """A stream that yields ``data`` and then ends, as a connection whose sender hung up.

    Call it inside a coroutine run by :func:`run` (a reader belongs to the running loop).
    """
    reader = asyncio.StreamReader(limit=1 << 20)
    reader.feed_data(data)
    reader.feed_eof()
    return reader
