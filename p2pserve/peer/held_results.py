"""``HeldResults``: pushed steps' outcomes held at a peer until the session's owner asks for them.

A peer that a pushed step ends at (the last hop), or any hop of a ring (unless its grant says
``report``: it sends them unasked), keeps each step's
ForwardResult and payload (or the ErrorReply it ended in) for the owner's ``AwaitResult``; an
owner that asks before the step ran waits here, one wait per session at a time (its stream
serves one frame at a time). A ring runs at most ``MAX_RING_AHEAD`` steps past the owner's
wait, so a session holds a bounded few; the oldest go first.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Optional

import msgspec

from p2pserve.errors import BadRequestError, P2PServeError
from p2pserve.protocol import MAX_RING_AHEAD, RingStopped
from p2pserve.transport.frames import write_frame_now


class HeldResults:
    """Outcomes held per session and the owners waiting for theirs (``wait_timeout_s`` at most)."""

    def __init__(self, wait_timeout_s: float, cap: int = MAX_RING_AHEAD + 4, max_report_backlog: int = 64 << 20):
        self.wait_timeout_s = wait_timeout_s
        self.cap = cap
        self.max_report_backlog = max_report_backlog  # bytes an owner's stream may hold unread
        self._results: dict[str, tuple[object, dict]] = {}  # sid -> (session, {step: (reply, payload)})
        self._waiters: dict[str, tuple[object, int, asyncio.Future]] = {}  # sid -> (session, step, future)

    def drop(self, session_id: str) -> None:
        """Forget what is held for a session (a new ring starts afresh)."""
        self._results.pop(session_id, None)

    def deliver(self, session, step: int, reply, payload: bytes, ring) -> None:
        """Hand ``step``'s outcome to the owner's waiting AwaitResult, or hold it for it; a ring
        hop before the last whose grant says ``report`` sends it to the owner at once instead (to
        an owner that stops reading, only until its stream's backlog is full; then held, capped)."""
        if ring is not None and ring.grant.report and not ring.last:
            writer = getattr(session.owner, "writer", None)
            if writer is not None and write_frame_now(writer, reply, payload, self.max_report_backlog):
                return
        held = self._results.setdefault(session.id, (session, {}))[1]
        held[step] = (reply, payload)
        while len(held) > self.cap:
            del held[min(held)]
        self.answer_waiter(session, ring)

    def answer_for(self, session, step: int, ring) -> Optional[tuple[object, bytes]]:
        """What answers a wait for ``step`` now: its held outcome, or (at a ring's last hop,
        ``ring``) the ring's failure or end; None: wait for it."""
        held = self._results.get(session.id, (None, {}))[1].pop(step, None)
        if held is not None:
            return held
        if ring is not None and ring.last and step > ring.last_run:
            if ring.failure is not None:
                return msgspec.structs.replace(ring.failure, step=step), b""
            if ring.ended_after is not None:
                return RingStopped(session_id=session.id, step=ring.ended_after), b""
        return None

    def answer_waiter(self, session, ring) -> None:
        """Answer the owner's pending wait if its answer is there now."""
        waiter = self._waiters.get(session.id)
        if waiter is not None and not waiter[2].done() and (answer := self.answer_for(session, waiter[1], ring)):
            waiter[2].set_result(answer)
            del self._waiters[session.id]

    async def wait(self, session, step: int, ring, watch=None) -> Optional[tuple[object, bytes]]:
        """``step``'s outcome, now or once it comes (P2PServeError after ``wait_timeout_s``).
        A wait that must suspend runs under ``watch`` (``ReadAhead.race``: None, the wait given
        up, when the owner hung up meanwhile)."""
        early = self.answer_for(session, step, ring)
        if early is not None:
            return early
        old = self._waiters.pop(session.id, None)
        if old is not None and not old[2].done():  # the owner gave up on it
            old[2].set_exception(BadRequestError(f"a later AwaitResult replaced the wait for step {old[1]}"))
        future = asyncio.get_running_loop().create_future()
        self._waiters[session.id] = (session, step, future)
        try:
            async with asyncio.timeout(self.wait_timeout_s):
                return await (future if watch is None else watch(future))
        except TimeoutError:
            raise P2PServeError(f"no pushed step {step} reached session {session.id} "
                                f"in {self.wait_timeout_s:.0f} s") from None
        finally:
            if self._waiters.get(session.id, (None, None, None))[2] is future:
                del self._waiters[session.id]

    def prune(self, is_open: Callable[[object], bool], why: Optional[Callable[[object], Exception]] = None) -> None:
        """Forget what is held for, and fail the waits of, sessions no longer open (each with
        ``why(session)``: what its owner is told, such as "range moved", which it retries)."""
        for sid in [s for s, (session, _) in self._results.items() if not is_open(session)]:
            del self._results[sid]
        for sid in [s for s, entry in self._waiters.items() if not is_open(entry[0])]:
            session, _, future = self._waiters.pop(sid)
            if not future.done():
                future.set_exception(why(session) if why is not None else
                                     BadRequestError(f"session {sid} closed while its owner waited"))
