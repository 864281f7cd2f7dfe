"""Ring mode: the last hop pushes each next token to the first hop itself (``client/ring.py``,
``peer/ring.py``).

The grant's pure bounds first; then the same real single-layer handlers of a tiny Llama on an
in-memory transport as ``test_push.py`` (its ``Swarm``): ringed greedy output equals
client-driven, also with a hop killed, seeded sampling reproduces client-driven, the ring stops
at the owner's bounds, and hostile peers (a third party injecting ring steps, a last hop
pushing past the budget, after a stop token, or out of order) get typed errors and no compute.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from p2pserve.client.push import PushConfig
from p2pserve.client.route_providers import ChainListRoutes
from p2pserve.errors import BadRequestError, MalformedFrameError
from p2pserve.peer.ring import RingState, check_grant, ring_position
from p2pserve.protocol import (
    MAX_RING_STOP_TOKENS,
    AllowPush,
    AwaitResult,
    ErrorReply,
    Forward,
    ForwardResult,
    PushAck,
    PushForward,
    PushHop,
    RingGrant,
    RingStopped,
    SamplingParams,
    decode_request,
)
from p2pserve.transport.frames import tensor_to_wire
from tests.unit.test_push import A, B, C, C2, _generate, _open, _raw, model, swarm  # noqa: F401 (fixtures)

RING = PushConfig(enabled=True, min_rtt_ms=0, ring=True)
PUSH = PushConfig(enabled=True, min_rtt_ms=0)


def _grant(**kw) -> RingGrant:
    base = dict(start_step=3, start_position=10, start_tokens=4, max_position=20)
    return RingGrant(**{**base, **kw})


def _fwd(step, position, n=1, outputs=1):
    meta, _ = tensor_to_wire(torch.zeros(n, dtype=torch.int64))
    return Forward(session_id="s", step=step, position=position, tensor=meta, outputs=outputs)


def test_ring_positions_follow_the_first_step():
    g = _grant()
    assert [ring_position(g, s) for s in (3, 4, 5, 6)] == [10, 14, 15, 16]


def test_a_hop_admits_each_ring_step_once_in_order_within_the_grant():
    ring = RingState.of(_grant(), "QmPrev")  # a hop after the first: it expects the start
    ring.admit(_fwd(3, 10, n=4), 4, None)
    ring.admit(_fwd(4, 14), 1, None)
    for bad in (_fwd(4, 14), _fwd(6, 16), _fwd(5, 14), _fwd(5, 15, n=2), _fwd(5, 15, outputs=1 + 1)):
        with pytest.raises(BadRequestError):  # a replay, a skip, a rewind, a prefill, a verification
            ring.admit(bad, bad.tensor.shape[0], None)
    for step in range(5, 11):  # up to max_position 20 (step 10 starts at 20)
        ring.admit(_fwd(step, ring_position(ring.grant, step)), 1, None)
    with pytest.raises(BadRequestError, match="max_position"):
        ring.admit(_fwd(11, 21), 1, None)


def test_the_first_hop_refuses_a_ring_step_after_a_stop_token():
    ring = RingState.of(_grant(stop_tokens=[2], route=[PushHop("QmB", "sb"), PushHop("QmLast", "sl")]), "QmLast")
    assert ring.first and ring.next_step == 4  # the owner pushes the start itself
    with pytest.raises(BadRequestError, match="stop token"):
        ring.admit(_fwd(4, 14), 1, 2)
    ring.admit(_fwd(4, 14), 1, 7)


def test_the_last_hop_goes_on_within_credit_and_stops_at_the_bounds():
    ring = RingState.of(_grant(stop_tokens=[2], successor=PushHop("QmA", "sa")), "QmPrev")
    assert ring.after(3, 14, 9) == "pause" and ring.paused == (4, 14, 9)  # no credit yet
    assert ring.resume(4) == (4, 14, 9) and ring.paused is None
    assert ring.after(4, 15, 9) == "pause" and ring.resume(4) is None  # credit not raised
    assert ring.resume(9) == (5, 15, 9)
    assert ring.after(5, 16, 2) == "stop" and ring.ended_after == 5  # a stop token
    budget = RingState.of(_grant(successor=PushHop("QmA", "sa")), "QmPrev")
    budget.resume(100)
    assert budget.after(10, 20, 9) == "push" and budget.after(11, 21, 9) == "stop"  # max_position 20


def test_grants_are_checked_for_one_role():
    check_grant(_grant(route=[PushHop("QmB", "sb"), PushHop("QmC", "sc")]), "QmC", "QmA")
    with pytest.raises(BadRequestError):  # the route must end at the peer that closes the ring
        check_grant(_grant(route=[PushHop("QmB", "sb"), PushHop("QmC", "sc")]), "QmB", "QmA")
    with pytest.raises(BadRequestError):
        check_grant(_grant(successor=PushHop("QmA", "sa")), "QmB", "QmA")
    with pytest.raises(BadRequestError):
        check_grant(_grant(max_position=12), "QmB", "QmA")


def test_hostile_ring_grants_are_refused_by_the_decoder():
    ok = AllowPush(session_id="s", from_peer="QmA", ring=_grant(stop_tokens=[1, 2]))
    assert decode_request(msgspec.msgpack.encode(ok)) == ok
    raw = msgspec.to_builtins(ok)
    for bad in ({"stop_tokens": list(range(MAX_RING_STOP_TOKENS + 1))}, {"start_tokens": 0},
                {"max_position": -1}, {"successor": {"peer_id": "QmA", "session_id": "s", "maddrs": ["/ip4/1.2.3.4"]}},
                {"addrs": ["/ip4/1.2.3.4/tcp/1"]}):
        with pytest.raises(MalformedFrameError):
            decode_request(msgspec.msgpack.encode({**raw, "ring": {**raw["ring"], **bad}}))


def test_ringed_greedy_output_equals_client_driven(swarm):
    route = [swarm.hops[A], swarm.hops[B], swarm.hops[C]]

    async def main():
        driven, _ = await _generate(swarm, ChainListRoutes([route]), PushConfig(), [5, 6, 7, 8], 10)
        ringed, p = await _generate(swarm, ChainListRoutes([route]), RING, [5, 6, 7, 8], 10)
        return driven, ringed, p

    driven, ringed, pipeline = asyncio.run(main())
    assert ringed == driven and not pipeline.failures
    assert pipeline.ring_steps == 9  # every token after the first came round the ring


def test_a_two_hop_ring_equals_client_driven(model):
    from tests.unit.test_push import Swarm

    s = Swarm(model, {A: (0, 2), C: (2, 3)})
    try:
        route = [s.hops[A], s.hops[C]]

        async def main():
            driven, _ = await _generate(s, ChainListRoutes([route]), PushConfig(), [1, 2, 3], 8)
            ringed, p = await _generate(s, ChainListRoutes([route]), RING, [1, 2, 3], 8)
            return driven, ringed, p

        driven, ringed, pipeline = asyncio.run(main())
        assert ringed == driven and pipeline.ring_steps == 7 and not pipeline.failures
    finally:
        s.stop()
