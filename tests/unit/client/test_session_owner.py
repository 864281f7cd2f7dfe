"""Sessions are bound to the stream that opened them, and every hop of a route has its own id.

A second client that knew only a session id could drive and close the
victim's session, because the peer looked sessions up by id alone and the client used one id on
every hop of a route.
"""

from __future__ import annotations

import asyncio

import pytest

from p2pserve.client.route_providers import PeerListRoutes
from p2pserve.errors import BadRequestError, SessionNotFoundError
from tests.harness import open_session, tiny_session_table
from tests.support.failover import generate, make_pipeline, network


@pytest.fixture
def table(tmp_path):
    return tiny_session_table(tmp_path / "tiny")[3]


def _open(table, name, owner):
    return open_session(table, name, owner)


def test_another_owner_can_neither_get_nor_close_a_session(table):
    alice, mallory = object(), object()
    session = _open(table, "s1", alice)
    free = table.budget.free
    with pytest.raises(SessionNotFoundError) as got:
        table.get("s1", mallory)
    with pytest.raises(SessionNotFoundError) as closed:
        table.close("s1", mallory)
    # Exactly the answer for an id that was never opened: nothing says the session exists.
    with pytest.raises(SessionNotFoundError) as unknown:
        table.get("never-opened", mallory)
    assert str(got.value).replace("s1", "X") == str(unknown.value).replace("never-opened", "X")
    assert str(closed.value).replace("s1", "X") == str(unknown.value).replace("never-opened", "X")
    assert table.get("s1", alice) is session and len(table) == 1 and table.budget.free == free
    table.close("s1", alice)
    assert len(table) == 0
    with pytest.raises(SessionNotFoundError):
        table.get("s1", alice)


def test_reopening_a_taken_id_leaves_the_owner_session_intact(table):
    alice, mallory = object(), object()
    session = _open(table, "s1", alice)
    with pytest.raises(BadRequestError, match="already open"):
        _open(table, "s1", mallory)
    assert table.get("s1", alice) is session
    with pytest.raises(SessionNotFoundError):
        table.get("s1", mallory)
    assert table.close_owned_by(mallory) == 0 and table.get("s1", alice) is session


def test_every_hop_of_a_route_and_every_reopened_route_has_its_own_session_id():
    net, peers = network()
    pipeline = make_pipeline(net, PeerListRoutes(8, peers, seed=0))
    seen: list[set[tuple[str, str]]] = []

    def snapshot(_i):
        seen.append(set(net.sessions))

    async def main():
        await pipeline.open()
        snapshot(0)
        net.kill_after[pipeline.route[-1].peer_id] = 3  # forces a failover onto a new route
        return await generate(pipeline, [1, 2, 3], 6, after_token=snapshot)

    asyncio.run(main())
    assert len(pipeline.failures) == 1
    first, last = seen[0], seen[-1]
    dead = pipeline.failures[0].hop.peer_id
    assert {pid for pid, _ in first & last} == {dead}  # only the dead peer never heard CloseSession
    second = last - first  # the route opened after the failover
    assert len(first) == 2 and len({sid for _, sid in first}) == 2  # two hops, two ids
    assert len(second) == 2 and len({sid for _, sid in second}) == 2
    assert not {sid for _, sid in first} & {sid for _, sid in second}  # the new route's ids are fresh
    assert all(len(sid) >= 32 for _, sid in first | second)
