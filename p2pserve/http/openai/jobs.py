"""A request's generations, each driven in a task of its own, reporting to one reader in batches.

The API process shares its cores with a peer, so its cost per token counts. A job puts each
piece of text into the request's :class:`EventBox` without awaiting anything; the one reader
(the response's writer) takes everything that arrived since it last looked, and writes it at
once. Tokens that arrive together (in one loop tick) leave in one write, and there is no task,
queue hop or future per token: at most one wake-up of the reader per batch.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional

log = logging.getLogger(__name__)

TERMINAL = ("end", "error", "cancelled")  # the last event of every GenerationJob


class EventBox:
    """Events put by any number of jobs, taken in batches by one reader."""

    def __init__(self):
        self._items: list[tuple] = []
        self._waiter: Optional[asyncio.Future] = None  # the reader's, while it waits on an empty box

    def put(self, item: tuple) -> None:
        """Add an event (never blocks; wakes the reader if it waits)."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def take(self) -> list[tuple]:
        """Every event put since the last take, in order (waits for one if there is none)."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


class GenerationJob:
    """One ``ReplyStream`` driven in its own task.

    ``opened`` resolves to None once the route is open, or to the job's last event if it ended
    before. With a ``box``, the job puts ``(index, "text", (piece, logprobs))`` per piece of text
    there, then exactly one of ``(index, "end", reply)``, ``(index, "error", exception)``,
    ``(index, "cancelled", None)``; ``final`` holds that last event. The stream is closed (its
    swarm sessions with it) before the last event, however the job ends; ``on_done(job)`` runs
    then too. Cancelling the job is how a disconnect stops a generation.
    """

    def __init__(self, stream, on_done: Callable, box: Optional[EventBox] = None, index: int = 0,
                 after: Optional[asyncio.Event] = None):
        self.stream = stream
        self.box, self.index = box, index
        self.final: Optional[tuple] = None
        self.opened: asyncio.Future = asyncio.get_running_loop().create_future()
        self._on_done = on_done
        self._after = after  # another choice's ``started``: its prompt is in the peers' caches then
        self.started = asyncio.Event()  # set once the first text came (the prompt ran) or it ended
        # the log-probabilities the generation keeps (streamed with their text), when it has any
        generation = getattr(stream, "generation", None)
        self._result = generation.result if generation is not None else None
        self.task = asyncio.create_task(self._run())
        # a task cancelled before it ever ran skips _run's finally: it still ends, as cancelled
        self.task.add_done_callback(lambda _: self._end(("cancelled", None)))

    async def _run(self) -> None:
        outcome: tuple = ("cancelled", None)
        try:
            if self._after is not None:
                await self._after.wait()
            await self.stream.open()
            self.opened.set_result(None)
            box, index, result, seen = self.box, self.index, self._result, 0
            async for piece in self.stream:
                new: list = []
                if result is not None and len(result.logprobs) > seen:
                    new = result.logprobs[seen:]
                    seen += len(new)
                if box is not None:
                    box.put((index, "text", (piece, new)))
                if not self.started.is_set():
                    self.started.set()
            outcome = ("end", self.stream.reply)
        except Exception as e:  # reported to the HTTP client (a CancelledError is not caught)
            outcome = ("error", e)
        finally:
            try:
                await self.stream.aclose()  # a no-op after a normal end; closes the sessions otherwise
            except Exception as e:
                log.warning(f"closing a generation's route failed: {e!r}")
            self._end(outcome)

    def _end(self, outcome: tuple) -> None:
        """Report the last event (the first call only)."""
        if self.final is not None:
            return
        self.final = outcome
        self._on_done(self)
        self.started.set()
        if not self.opened.done():
            self.opened.set_result(outcome)
        if self.box is not None:
            self.box.put((self.index, *outcome))

    async def outcome(self) -> tuple:
        """The last event, once the job ended."""
        await asyncio.wait([self.task])
        return self.final

    def cancel(self) -> None:
        """Stop the generation (a no-op once it ended)."""
        self.task.cancel()
