"""Failover without a network: bans with backoff, re-routing, replay as one prefill, bounded retries.

The real pipeline (connections, frame codec) runs over an in-memory transport against fake
peers (``p2pserve.testing.FakePeerNetwork``) whose 'model' depends on the whole token history.
"""

from __future__ import annotations

import asyncio

import pytest

from p2pserve.client.failover import BanList, FailoverState, FailureRecord, failure_message, next_move, route_pause
from p2pserve.client.hop import Hop
from p2pserve.client.pipeline import Pipeline
from p2pserve.client.route_providers import PeerListRoutes
from p2pserve.client.routing import Masks
from p2pserve.config import ClientConfig
from p2pserve.errors import (
    AllRoutesOverloadedError,
    BadRequestError,
    GenerationFailedError,
    NoRouteError,
    OverloadedError,
    RangeMovedError,
)
from p2pserve.testing import FakeClock, FixedRoutes, fake_next_token
from tests.support.failover import SPANS, generate, make_pipeline, network, run


def reference(prompt, n):
    hist, out, pending = [], [], prompt
    for _ in range(n):
        hist += pending
        tok = fake_next_token(hist)
        out.append(tok)
        pending = [tok]
    return out


def test_ban_backoff_doubles_and_caps():
    clock = FakeClock()
    bans = BanList(5.0, 12.0, clock)
    assert bans.ban("p") == 5.0 and bans.ban("p") == 10.0 and bans.ban("p") == 12.0
    assert bans.active() == {"p"}
    clock.advance(12.5)
    assert bans.active() == frozenset()
    flat = BanList(5.0, 100.0, clock, escalate=False)
    assert flat.ban("q") == 5.0 and flat.ban("q") == 5.0


def test_next_move_decisions():
    assert next_move(BadRequestError("too long"), 1, 3) == "raise"
    assert next_move(ConnectionError("gone"), 4, 3) == "give up"
    assert next_move(RangeMovedError("moved"), 1, 3) == "re-read"
    assert next_move(OverloadedError("full"), 1, 3) == "re-route"


def test_kill_mid_generation_replays_history_and_output_is_identical():
    net, peers = network()
    pipeline = make_pipeline(net, PeerListRoutes(8, peers, seed=0))

    async def main():
        await pipeline.open()
        victim = pipeline.route[-1].peer_id
        net.kill_after[victim] = 5  # dies right after the 5th token: the 6th step finds it dead
        return victim, await generate(pipeline, [1, 2, 3], 12)

    victim, out = run(main())
    assert out == reference([1, 2, 3], 12)
    assert [f.hop.peer_id for f in pipeline.failures] == [victim]
    assert victim not in {h.peer_id for h in pipeline.route}
    # 5 steps sent 3 + 4 tokens; the 6th failed and was replayed as one prefill of 7 + 1
    assert net.sampled[:6] == [3, 1, 1, 1, 1, 8]
    assert pipeline.position == len(pipeline.history) == 3 + 11


def test_kill_two_peers_one_after_another():
    net, peers = network()
    pipeline = make_pipeline(net, PeerListRoutes(8, peers, seed=0))
    net.kill_after = {"a1": 3, "b1": 7}
    out = run(generate(pipeline, [5, 6], 14))
    assert out == reference([5, 6], 14)
    assert {h.peer_id for h in pipeline.route} == {"a2", "b2"}


def test_every_replica_dead_fails_clearly_within_retries():
    net, peers = network()
    pipeline = make_pipeline(net, PeerListRoutes(8, peers, seed=0))
    net.kill_after = {"b1": 2, "b2": 2}
    with pytest.raises(GenerationFailedError) as e:
        run(generate(pipeline, [1], 10))
    text = str(e.value)
    assert "b1[" in text and "b2[" in text and "no usable peer serves layer 4" in text
    assert len(pipeline.failures) <= ClientConfig().max_retries + 1


def test_retry_bound_is_honoured():
    net, _ = network()
    net.kill("b1")
    # a route provider that keeps offering a dead route: only the retry bound stops it
    config = ClientConfig(max_retries=2)
    pipeline = make_pipeline(net, FixedRoutes([Hop("a1", 0, 4), Hop("b1", 4, 8)]), config)
    with pytest.raises(GenerationFailedError) as e:
        run(pipeline.step([1]))
    assert len(pipeline.failures) == 3
    assert "after 3 attempt(s)" in str(e.value)


def test_overloaded_peers_are_masked_and_all_overloaded_is_distinct():
    net, peers = network()
    net.refuse["a1"] = "overloaded"
    pipeline = make_pipeline(net, PeerListRoutes(8, peers, seed=0))
    out = run(generate(pipeline, [1, 2], 3))
    assert out == reference([1, 2], 3)
    assert all(h.peer_id != "a1" for h in pipeline.route)
    assert [f.action for f in pipeline.failures if f.hop.peer_id == "a1"] in ([], ["masked as overloaded 5s"])

    net, peers = network()
    net.refuse.update(a1="overloaded", a2="overloaded")
    pipeline = make_pipeline(net, PeerListRoutes(8, peers, seed=0))
    with pytest.raises(AllRoutesOverloadedError):
        run(pipeline.step([1]))


def test_no_route_before_any_failure_is_a_routing_error():
    net, peers = network()
    pipeline = make_pipeline(net, PeerListRoutes(8, peers[:2], seed=0))
    with pytest.raises(NoRouteError):
        run(pipeline.step([1]))


def test_bad_request_is_not_retried():
    net, peers = network({"a1": (0, 8)})
    net.refuse["a1"] = "bad_request"
    pipeline = make_pipeline(net, PeerListRoutes(8, peers, seed=0))
    with pytest.raises(BadRequestError):
        run(pipeline.step([1]))
    assert len(pipeline.failures) == 1 and pipeline.failures[0].action == "not retried"


def test_range_moved_bans_no_one_and_rereads_the_routes():
    """A peer that flipped ranges is healthy: the client re-reads its routes and may use it again."""
    net, _ = network({"a1": (0, 8)})
    net.refuse_once["a1"] = "range_moved"
    routes = FixedRoutes([Hop("a1", 0, 8)])
    config = ClientConfig(max_retries=3, stale_route_pause_s=0.0)
    state = FailoverState(config, FakeClock())
    pipeline = Pipeline(net.client(), routes, "fake-model", 8, max_length=256, config=config, state=state)
    assert run(generate(pipeline, [1, 2], 3)) == reference([1, 2], 3)
    assert [f.action for f in pipeline.failures] == ["route stale, re-reading the plan"]
    assert routes.invalidated == 1 and not state.bans.active() and not state.overloaded.active()


def test_rewind_then_failure_replays_the_truncated_history():
    net, peers = network()
    pipeline = make_pipeline(net, PeerListRoutes(8, peers, seed=0))

    async def main():
        pending = [1, 2, 3, 4]
        for _ in range(3):
            pending = [await pipeline.step(pending)]
        pipeline.rewind(2)
        for h in pipeline.route:
            if h.peer_id.startswith("a"):
                net.kill(h.peer_id)
        try:
            return await pipeline.step([9])
        finally:
            await pipeline.close()

    assert run(main()) == fake_next_token([1, 2, 9])
    assert pipeline.history == [1, 2, 9]


def test_failure_message_lists_hops():
    recs = [FailureRecord(Hop("peerA", 0, 4, ("/ip4/1.2.3.4/tcp/1/p2p/peerA",)), "ConnectionError: x", "banned 5s")]
    text = failure_message(recs, 2, RuntimeError("no route"))
    assert "peerA[0:4) at /ip4/1.2.3.4/tcp/1/p2p/peerA: ConnectionError: x (banned 5s)" in text
    assert "then: RuntimeError: no route" in text


def test_masks_are_what_the_state_banned():
    state = FailoverState(ClientConfig(), FakeClock())
    state.record(Hop("p", 0, 4), ConnectionError("x"))
    state.record(Hop("q", 0, 4), OverloadedError("full"))
    assert state.masks() == Masks(banned=frozenset({"p"}), overloaded=frozenset({"q"}))


def test_a_failed_parallel_open_cancels_and_closes_its_siblings():
    """When one hop refuses, the opens still under way are cancelled and
    their streams closed at once (the peer frees what it reserved), not left to their timeouts."""
    net, hops = network({"a1": (0, 4), "b1": (4, 8)})
    net.refuse["a1"] = "bad_request"
    net.stall.add("b1")
    config = ClientConfig(max_retries=0, hop_timeout_s=60.0, stale_route_pause_s=0.0)
    pipeline = make_pipeline(net, FixedRoutes(hops), config=config)

    async def main():
        async with asyncio.timeout(5):  # not the 60 s hop timeout of the stalled sibling
            with pytest.raises(BadRequestError):
                await pipeline.step([1, 2, 3])
        await asyncio.sleep(0)
        await pipeline.close()

    run(main())
    assert net.stall_released == ["b1"]


@pytest.mark.parametrize("how,index", [("token", 0), ("vocab", 1), ("nan", 0), ("position", 1)])
def test_a_malformed_reply_is_blamed_on_the_hop_that_sent_it(how, index):
    """A middle hop answering a token and no tensor made the client pass the previous hop's
    activations on (layers silently skipped); a last hop's token 10**6 was blamed on the first
    hop. Each lie now bans the liar, the route is rebuilt, and the output is unchanged."""
    net, hops = network()
    first_route = run(PeerListRoutes(8, hops, seed=0).route(Masks()))  # the pipeline's, same seed
    liar = first_route[index].peer_id
    net.corrupt[liar] = how
    pipeline = Pipeline(net.client(), PeerListRoutes(8, hops, seed=0), "fake-model", 8, max_length=256,
                        config=ClientConfig(max_retries=3, stale_route_pause_s=0.0),
                        state=FailoverState(ClientConfig(), FakeClock()), vocab_size=1000)
    out = run(generate(pipeline, [1, 2, 3], 6))
    assert out == reference([1, 2, 3], 6)
    blamed = {f.hop.peer_id for f in pipeline.failures}
    assert blamed == {liar} and all("banned" in f.action for f in pipeline.failures)


class RoutesAfter:
    """No route for the first ``gaps`` reads (each ``invalidate()`` is one new read), then ``hops``:
    a swarm in which a replica is still loading, or a ban is about to expire."""

    def __init__(self, hops, gaps: int, overloaded: bool = False):
        self.hops, self.gaps, self.overloaded = list(hops), gaps, overloaded

    async def route(self, masks):
        if self.gaps > 0:
            raise NoRouteError("no usable peer serves layer 4", {}, self.overloaded)
        return list(self.hops)

    def invalidate(self) -> None:
        self.gaps -= 1


def test_route_pause_doubles_up_to_the_budget():
    gap = NoRouteError("no usable peer serves layer 4", {}, False)
    waits, waited = [], 0.0
    while (pause := route_pause(gap, waited, 5.0)) is not None:
        waits.append(pause)
        waited += pause
    assert waits == [0.25, 0.5, 1.0, 2.0, 1.25]
    assert route_pause(gap, 0.0, 0.0) is None  # the default: fail at once
    assert route_pause(NoRouteError("all full", {}, True), 0.0, 5.0) is None  # overload is not waited for


def test_a_request_waits_for_a_route_to_come_back_and_waits_are_not_attempts():
    net, _ = network({"a1": (0, 4), "b1": (4, 8)})
    config = ClientConfig(max_retries=1, stale_route_pause_s=0.0, no_route_wait_s=5.0)
    pipeline = make_pipeline(net, RoutesAfter([Hop("a1", 0, 4), Hop("b1", 4, 8)], gaps=2), config)
    assert run(generate(pipeline, [1, 2], 3)) == reference([1, 2], 3)
    assert not pipeline.failures


def test_without_a_wait_budget_no_route_fails_at_once():
    net, _ = network({"a1": (0, 4), "b1": (4, 8)})
    pipeline = make_pipeline(net, RoutesAfter([Hop("a1", 0, 4), Hop("b1", 4, 8)], gaps=1))
    with pytest.raises(NoRouteError):
        run(pipeline.step([1]))
