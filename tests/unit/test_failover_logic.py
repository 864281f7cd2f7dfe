"""Failover without a network: bans with backoff, re-routing, replay as one prefill, bounded retries."""

from __future__ import annotations

import asyncio

import pytest

from p2pserve.client.connection import Hop
from p2pserve.client.failover import (
    AllRoutesOverloadedError,
    BanList,
    ChainListRoutes,
    FailoverSession,
    FailoverState,
    HopFailure,
    PeerListRoutes,
    failure_message,
)
from p2pserve.client.routing import Masks, NoRouteError
from p2pserve.config import ClientConfig
from p2pserve.errors import BadRequestError, GenerationFailedError, OverloadedError, RangeMovedError


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def model_token(history: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole history (like real ones)."""
    return (sum((i + 1) * t for i, t in enumerate(history)) * 31 + len(history)) % 1000


class FakeSwarm:
    """Sessions whose hops fail when their peer is dead or overloaded."""

    def __init__(self):
        self.dead: set[str] = set()
        self.overloaded: set[str] = set()
        self.kill_after_steps: dict[str, int] = {}  # peer -> dies when the global step count reaches this
        self.steps = 0
        self.prefills: list[int] = []  # tokens sent per step

    async def open_session(self, hops):
        for h in hops:
            if h.peer_id in self.dead:
                raise HopFailure(h, ConnectionError("connection refused"))
            if h.peer_id in self.overloaded:
                raise HopFailure(h, OverloadedError("KV budget full", peer=h.peer_id))
        return FakeSession(self, hops)


class FakeSession:
    def __init__(self, swarm: FakeSwarm, hops):
        self.swarm, self.hops, self.history, self.closed = swarm, hops, [], False

    @property
    def position(self):
        return len(self.history)

    async def step(self, token_ids):
        self.swarm.steps += 1
        for peer, at in self.swarm.kill_after_steps.items():
            if self.swarm.steps >= at:
                self.swarm.dead.add(peer)
        for h in self.hops:
            if h.peer_id in self.swarm.dead:
                raise HopFailure(h, ConnectionError(f"peer {h.peer_id} closed the stream"))
        self.swarm.prefills.append(len(token_ids))
        self.history.extend(token_ids)
        return model_token(self.history)

    def rewind(self, position):
        del self.history[position:]

    async def close(self):
        self.closed = True


PEERS = [("a1", 0, 4, ()), ("a2", 0, 4, ()), ("b1", 4, 8, ()), ("b2", 4, 8, ())]


def make_session(swarm, config=ClientConfig(max_retries=3), clock=None):
    routes = PeerListRoutes(8, PEERS, seed=0)
    state = FailoverState(config, clock or Clock())
    return FailoverSession(routes, swarm.open_session, max_length=256, config=config, state=state)


async def run(session, prompt, n):
    out, pending = [], prompt
    for _ in range(n):
        tok = await session.step(pending)
        out.append(tok)
        pending = [tok]
    return out


def reference(prompt, n):
    hist, out, pending = [], [], prompt
    for _ in range(n):
        hist += pending
        tok = model_token(hist)
        out.append(tok)
        pending = [tok]
    return out


def test_ban_backoff_doubles_and_caps():
    clock = Clock()
    bans = BanList(5.0, 12.0, clock)
    assert bans.ban("p") == 5.0 and bans.ban("p") == 10.0 and bans.ban("p") == 12.0
    assert bans.active() == {"p"}
    clock.t += 12.5
    assert bans.active() == frozenset()
    flat = BanList(5.0, 100.0, clock, escalate=False)
    assert flat.ban("q") == 5.0 and flat.ban("q") == 5.0


def test_kill_mid_generation_replays_history_and_output_is_identical():
    swarm = FakeSwarm()
    session = make_session(swarm)
    asyncio.run(session.open())
    victim = session.route[-1].peer_id
    swarm.kill_after_steps[victim] = 6
    out = asyncio.run(run(session, [1, 2, 3], 12))
    assert out == reference([1, 2, 3], 12)
    assert [f.hop.peer_id for f in session.failures] == [victim]
    assert victim not in {h.peer_id for h in session.route}
    # 5 steps sent 3 + 4 tokens; the 6th failed and was replayed as one prefill of 7 + 1
    assert swarm.prefills[:6] == [3, 1, 1, 1, 1, 8]
    assert session.position == len(session.history) == 3 + 11


def test_kill_two_peers_one_after_another():
    swarm = FakeSwarm()
    session = make_session(swarm)
    swarm.kill_after_steps = {"a1": 4, "b1": 8}
    out = asyncio.run(run(session, [5, 6], 14))
    assert out == reference([5, 6], 14)
    assert {h.peer_id for h in session.route} == {"a2", "b2"}


def test_every_replica_dead_fails_clearly_within_retries():
    swarm = FakeSwarm()
    session = make_session(swarm)
    swarm.kill_after_steps = {"b1": 3, "b2": 3}
    with pytest.raises(GenerationFailedError) as e:
        asyncio.run(run(session, [1], 10))
    text = str(e.value)
    assert "b1[" in text and "b2[" in text and "no usable peer serves layer 4" in text
    assert len(session.failures) <= ClientConfig().max_retries + 1


def test_retry_bound_is_honoured():
    swarm = FakeSwarm()
    swarm.dead = {"b1", "b2"}
    # a route provider that keeps offering dead routes: only the retry bound stops it
    routes = ChainListRoutes([[Hop("a1", 0, 4), Hop("b1", 4, 8)]])

    async def any_route(masks):
        return await routes(Masks())

    config = ClientConfig(max_retries=2)
    session = FailoverSession(any_route, swarm.open_session, 64, config, FailoverState(config, Clock()))
    with pytest.raises(GenerationFailedError) as e:
        asyncio.run(session.step([1]))
    assert len(session.failures) == 3
    assert "after 3 attempt(s)" in str(e.value)


def test_overloaded_peers_are_masked_and_all_overloaded_is_distinct():
    swarm = FakeSwarm()
    swarm.overloaded = {"a1"}
    session = make_session(swarm)
    out = asyncio.run(run(session, [1, 2], 3))
    assert out == reference([1, 2], 3)
    assert all(h.peer_id != "a1" for h in session.route)
    assert [f.action for f in session.failures if f.hop.peer_id == "a1"] in ([], ["masked as overloaded 5s"])

    swarm = FakeSwarm()
    swarm.overloaded = {"a1", "a2"}
    session = make_session(swarm)
    with pytest.raises(AllRoutesOverloadedError):
        asyncio.run(session.step([1]))


def test_no_route_before_any_failure_is_a_routing_error():
    swarm = FakeSwarm()
    session = FailoverSession(PeerListRoutes(8, PEERS[:2], seed=0), swarm.open_session, 64)
    with pytest.raises(NoRouteError):
        asyncio.run(session.step([1]))


def test_bad_request_is_not_retried():
    class Refusing(FakeSwarm):
        async def open_session(self, hops):
            raise HopFailure(hops[0], BadRequestError("prompt too long", peer=hops[0].peer_id))

    session = make_session(Refusing())
    with pytest.raises(BadRequestError):
        asyncio.run(session.step([1]))
    assert len(session.failures) == 1 and session.failures[0].action == "not retried"


def test_range_moved_bans_no_one_and_rereads_the_routes():
    """A peer that flipped ranges is healthy: the client re-reads its routes and may use it again."""

    class Moved(FakeSwarm):
        moved_once = False

        async def open_session(self, hops):
            if not self.moved_once:
                self.moved_once = True
                raise HopFailure(hops[0], RangeMovedError("layers [0, 4) are outside", peer=hops[0].peer_id))
            return await super().open_session(hops)

    class Routes(PeerListRoutes):
        invalidated = 0

        def invalidate(self):
            self.invalidated += 1

    config = ClientConfig(max_retries=3, stale_route_pause_s=0.0)
    routes = Routes(8, PEERS, seed=0)
    state = FailoverState(config, Clock())
    session = FailoverSession(routes, Moved().open_session, max_length=256, config=config, state=state)
    assert asyncio.run(run(session, [1, 2], 3)) == reference([1, 2], 3)
    assert [f.action for f in session.failures] == ["route stale, re-reading the plan"]
    assert routes.invalidated == 1 and not state.bans.active() and not state.overloaded.active()


def test_rewind_then_failure_replays_the_truncated_history():
    swarm = FakeSwarm()
    session = make_session(swarm)
    asyncio.run(run(session, [1, 2, 3, 4], 3))
    session.rewind(2)
    for h in session.route:
        swarm.dead.add(h.peer_id) if h.peer_id.startswith("a") else None
    tok = asyncio.run(session.step([9]))
    assert tok == model_token([1, 2, 9])
    assert session.history == [1, 2, 9]


def test_failure_message_lists_hops():
    from p2pserve.client.failover import FailureRecord

    recs = [FailureRecord(Hop("peerA", 0, 4, ("/ip4/1.2.3.4/tcp/1/p2p/peerA",)), "ConnectionError: x", "banned 5s")]
    text = failure_message(recs, 2, RuntimeError("no route"))
    assert "peerA[0:4) at /ip4/1.2.3.4/tcp/1/p2p/peerA: ConnectionError: x (banned 5s)" in text
    assert "then: RuntimeError: no route" in text
