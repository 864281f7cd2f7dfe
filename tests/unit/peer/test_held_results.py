"""An owner waiting for a pushed step of a session that closes meanwhile is told why, as its
next request would be: a peer that moved answers "range moved", which the client retries."""

from __future__ import annotations

import asyncio

import pytest
import torch

from p2pserve.errors import BadRequestError, RangeMovedError, SessionNotFoundError
from p2pserve.peer.held_results import HeldResults
from p2pserve.peer.kv_cache import KVBudget
from p2pserve.peer.sessions import SessionTable
from tests.unit.peer.test_paged_kv import _open, _spec


def _table(clock=None) -> SessionTable:
    kw = {"clock": clock} if clock is not None else {}
    return SessionTable(spec=_spec(), served=(0, 8), budget=KVBudget(1 << 20), idle_timeout_s=60.0,
                        torch_dtype=torch.float32, **kw)


def test_a_closed_session_is_explained_as_its_owner_would_be_told():
    owner, table = object(), _table()
    moved, closed = _open(table, "m", owner=owner), _open(table, "c", owner=owner)
    table.close("c", owner)
    table.retarget((0, 4))
    assert isinstance(table.closed_error(moved), RangeMovedError)
    error = table.closed_error(closed)
    assert isinstance(error, SessionNotFoundError) and not isinstance(error, RangeMovedError)


@pytest.mark.parametrize("why, raised", [(None, BadRequestError), (lambda s: RangeMovedError("moved"), RangeMovedError)])
def test_a_wait_on_a_session_that_closes_fails_with_why(why, raised):
    async def main():
        held, session = HeldResults(wait_timeout_s=30.0), type("S", (), {"id": "s"})()
        wait = asyncio.ensure_future(held.wait(session, 3, None))
        await asyncio.sleep(0)
        held.prune(lambda s: False, why)
        with pytest.raises(raised):
            await wait

    asyncio.run(main())


def test_ring_replies_sent_unasked_stop_at_the_backlog_of_an_owner_that_does_not_read():
    """A ring hop before the last sends each step's reply to the owner unasked; an owner that
    never reads its stream gets them held (capped) once the stream holds the backlog's worth, so
    it cannot make the peer buffer without bound."""
    import socket
    from types import SimpleNamespace

    from p2pserve.protocol import ForwardResult, RingGrant
    from p2pserve.peer.ring import RingState
    from p2pserve.transport.frames import unsent_bytes

    async def main():
        mine, theirs = socket.socketpair()  # the owner's end is never read
        _, writer = await asyncio.open_connection(sock=mine)
        try:
            owner = SimpleNamespace(writer=writer)
            table = _table()
            session = _open(table, "s", owner=owner)
            ring = RingState.of(RingGrant(start_step=0, start_position=0, start_tokens=1, max_position=4096,
                                          report=True), "prev")
            held = HeldResults(5.0, max_report_backlog=1 << 20)
            payload = bytes(256 << 10)
            for step in range(40):
                held.deliver(session, step, ForwardResult(session_id="s", step=step, position=step + 1), payload, ring)
            assert unsent_bytes(writer) < (1 << 20) + 2 * len(payload)
            assert held.answer_for(session, 39, ring) is not None  # held once the backlog was full
        finally:
            writer.close()
            theirs.close()

    asyncio.run(main())
