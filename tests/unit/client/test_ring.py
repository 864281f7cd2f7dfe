"""Ring mode: the last hop pushes each next token to the first hop itself (``client/ring.py``,
``peer/ring.py``).

The grant's pure bounds first; then the same real single-layer handlers of a tiny Llama on an
in-memory transport as ``test_push.py`` (``tests/push_swarm.py``'s ``Swarm``): ringed greedy output equals
client-driven, also with a hop killed, seeded sampling reproduces client-driven, the ring stops
at the owner's bounds, and hostile peers (a third party injecting ring steps, a last hop
pushing past the budget, after a stop token, or out of order) get typed errors and no compute.
"""

from __future__ import annotations

from dataclasses import replace

import asyncio
import dataclasses

import msgspec
import pytest
import torch

from p2pserve.cli import build_parser
from p2pserve.cli.api import client_from_args
from p2pserve.client.generation import Generation
from p2pserve.client.params import GenerationParams
from p2pserve.client.pipeline import Pipeline
from p2pserve.config import PushConfig
from p2pserve.client.route_providers import ChainListRoutes
from p2pserve.errors import BadRequestError, ConfigError, MalformedFrameError
from p2pserve.config import ForwardingConfig
from p2pserve.peer.next_hop import UNREACHABLE
from p2pserve.peer.ring import RingState, check_grant, ring_position
from p2pserve.protocol import MAX_RING_AHEAD
from p2pserve.protocol import (
    MAX_RING_STOP_TOKENS,
    AllowPush,
    ErrorReply,
    Forward,
    ForwardResult,
    PushAck,
    PushForward,
    PushHop,
    RingGrant,
    SamplingParams,
    decode_request,
)
from p2pserve.transport.frames import tensor_to_wire
from tests.push_swarm import (  # noqa: F401 (model, swarm: fixtures)
    A,
    B,
    C,
    C2,
    CONFIG,
    PEER,
    Swarm,
    _generate,
    _open,
    _raw,
    model,
    swarm,
)

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
    assert ring.resume(4, 3) == (4, 14, 9) and ring.paused is None
    assert ring.after(4, 15, 9) == "pause" and ring.resume(4, 3) is None  # credit not raised
    assert ring.resume(9, 4) == (5, 15, 9)
    assert ring.after(5, 16, 2) == "stop" and ring.ended_after == 5  # a stop token
    budget = RingState.of(_grant(successor=PushHop("QmA", "sa")), "QmPrev")
    budget.resume(100, 90)
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
    assert pipeline.forwarding.ring_steps == 9  # every token after the first came round the ring


def test_peers_that_cannot_find_each_other_refuse_the_ring_and_the_route_is_driven(model):
    """Peers named by a fixed list, each in a DHT of its own, hold no record of each other: each
    refuses a ring grant naming a peer it cannot find, and the client drives the same route
    from the first step, with nobody banned or set aside and no step lost."""
    s = Swarm(model, {A: (0, 1), B: (1, 2), C: (2, 3)}, announced=False)
    try:
        route = [s.hops[A], s.hops[B], s.hops[C]]

        async def main():
            driven, _ = await _generate(s, ChainListRoutes([route]), PushConfig(), [1, 2, 3], 8)
            ringed, p = await _generate(s, ChainListRoutes([route]), RING, [1, 2, 3], 8)
            return driven, ringed, p

        driven, ringed, pipeline = asyncio.run(main())
        assert ringed == driven and not pipeline.failures and pipeline.forwarding.refused
        assert pipeline.forwarding.ring_steps == 0 and len(pipeline.route_log) == 1
        assert not pipeline.state.bans.active() and not pipeline.state.unlinked.active()
    finally:
        s.stop()


def test_a_two_hop_ring_equals_client_driven(model):
    s = Swarm(model, {A: (0, 2), C: (2, 3)})
    try:
        route = [s.hops[A], s.hops[C]]

        async def main():
            driven, _ = await _generate(s, ChainListRoutes([route]), PushConfig(), [1, 2, 3], 8)
            ringed, p = await _generate(s, ChainListRoutes([route]), RING, [1, 2, 3], 8)
            return driven, ringed, p

        driven, ringed, pipeline = asyncio.run(main())
        assert ringed == driven and pipeline.forwarding.ring_steps == 7 and not pipeline.failures
    finally:
        s.stop()


def test_a_killed_last_hop_is_banned_and_the_ring_replayed_on_a_new_route(swarm):
    routes = ChainListRoutes([[swarm.hops[A], swarm.hops[B], swarm.hops[C]],
                              [swarm.hops[A], swarm.hops[B], swarm.hops[C2]]])

    async def main():
        ref, _ = await _generate(swarm, ChainListRoutes([routes.chains[1]]), PushConfig(), [3, 1, 4], 10)
        got, p = await _generate(swarm, routes, RING, [3, 1, 4], 10, kill_after=(4, C))
        return ref, got, p

    ref, got, pipeline = asyncio.run(main())
    assert got == ref and [f.hop.peer_id for f in pipeline.failures] == [C]
    assert pipeline.route[-1].peer_id == C2 and pipeline.forwarding.ring_steps >= 5


def test_a_killed_middle_hop_is_named_up_the_ring(model):
    """B dies mid-ring: A's link to it breaks, A tells C (which pushed A its ring steps), and C
    answers the client's wait naming B; the client bans B, not A or C."""
    B2 = "QmPeerE"
    s = Swarm(model, {A: (0, 1), B: (1, 2), B2: (1, 2), C: (2, 3)})
    try:
        routes = ChainListRoutes([[s.hops[A], s.hops[B], s.hops[C]], [s.hops[A], s.hops[B2], s.hops[C]]])

        async def main():
            ref, _ = await _generate(s, ChainListRoutes([routes.chains[1]]), PushConfig(), [8, 6, 4], 10)
            got, p = await _generate(s, routes, RING, [8, 6, 4], 10, kill_after=(5, B))
            return ref, got, p

        ref, got, pipeline = asyncio.run(main())
        assert got == ref and [f.hop.peer_id for f in pipeline.failures] == [B]
    finally:
        s.stop()


def test_ringed_seeded_sampling_reproduces_client_driven(swarm):
    sampling = SamplingParams(temperature=1.0, top_k=50, seed=11)
    route = [swarm.hops[A], swarm.hops[B], swarm.hops[C]]

    async def main():
        ref, _ = await _generate(swarm, ChainListRoutes([route]), PushConfig(), [2, 7, 1], 10, sampling=sampling)
        got, p = await _generate(swarm, ChainListRoutes([route]), RING, [2, 7, 1], 10, sampling=sampling)
        return ref, got, p

    ref, got, pipeline = asyncio.run(main())
    assert got == ref and pipeline.forwarding.ring_steps == 9


def test_a_step_off_the_ring_drains_it_and_starts_another(swarm):
    """A rewind (a stop string, a new turn) is not the ring's next token: the ring is drained
    (its positions past the rewind are dropped by the next step) and a new one started."""
    route = [swarm.hops[A], swarm.hops[B], swarm.hops[C]]

    async def run(push):
        pipeline = Pipeline(swarm.net.transport("QmClient"), ChainListRoutes([route]), swarm.spec.model_id, 3, 64,
                            config=replace(CONFIG, push=push), vocab_size=swarm.spec.vocab_size)
        out, pending = [], [4, 4, 2]
        try:
            for i in range(12):
                if i == 6:  # take two tokens back and go on from another one
                    pipeline.rewind(pipeline.position - 2)
                    del out[-2:]
                    pending = [9]
                tok = await pipeline.step(pending)
                out.append(tok)
                pending = [tok]
            return out, pipeline.forwarding.ring_steps
        finally:
            await pipeline.close()

    async def main():
        return await run(PushConfig()), await run(RING)

    (ref, _), (got, ring_steps) = asyncio.run(main())
    assert got == ref and ring_steps == 10  # two starts: 12 steps, 2 of them not round the ring


async def _ringed_sessions(swarm, max_position=12, stop_tokens=(2,)):
    """Sessions sa, sb, sc on A, B, C owned by one client, granted a ring starting at step 0
    with 3 tokens; the client's streams."""
    conns = [await _open(swarm, "QmClient", pid, sid) for pid, sid in ((A, "sa"), (B, "sb"), (C, "sc"))]
    hops = [PushHop(A, "sa"), PushHop(B, "sb"), PushHop(C, "sc")]
    base = dict(start_step=0, start_position=0, start_tokens=3, max_position=max_position, stop_tokens=list(stop_tokens))
    await conns[0].call(AllowPush(session_id="sa", from_peer=C, ring=RingGrant(**base, route=hops[1:])))
    await conns[1].call(AllowPush(session_id="sb", from_peer=A, ring=RingGrant(**base)))
    await conns[2].call(AllowPush(session_id="sc", from_peer=B, ring=RingGrant(**base, successor=hops[0])))
    return conns


def _ring_step(step, position, token, session="sa"):
    meta, data = tensor_to_wire(torch.tensor([token], dtype=torch.int64))
    return PushForward(forward=Forward(session_id=session, step=step, position=position, tensor=meta), ring=True), data


def test_a_third_party_cannot_inject_ring_steps(swarm):
    """Only the peer the owner granted (the last hop, C) may push ring steps into the first
    hop's session: anyone else gets the unknown_session of an id never opened, and nothing runs."""
    async def main():
        conns = await _ringed_sessions(swarm)
        eve = swarm.net.transport("QmEve")
        replies = [await _raw(eve, A, *_ring_step(1, 3, 5)),
                   await _raw(swarm.net.transport(B), A, *_ring_step(1, 3, 5))]  # B is granted into C's... not A's
        position = swarm.handlers[A].table.get("sa", swarm.handlers[A].forwarder._grants["sa"][0].owner).position
        for c in conns:
            await c.close()
        return replies, position

    replies, position = asyncio.run(main())
    assert all(isinstance(r, ErrorReply) and r.code == "unknown_session" for r in replies)
    assert position == 0


def test_a_last_hop_cannot_make_the_first_run_past_the_owners_bounds(swarm):
    """C, the granted last hop, pushes ring steps into A's session by hand: out of order, at a
    rewound position, after a stop token, past max_position. Each is refused (bad_request) before
    any compute; only the steps the grant allows run."""
    async def main():
        conns = await _ringed_sessions(swarm, max_position=4, stop_tokens=(2,))
        # the owner's own start: 3 tokens at 0 through A, B, C
        meta, data = tensor_to_wire(torch.tensor([1, 2, 3], dtype=torch.int64))
        start = PushForward(forward=Forward(session_id="sa", step=0, position=0, tensor=meta),
                            route=[PushHop(B, "sb"), PushHop(C, "sc")], ring=True)
        await conns[0].call(start, data)
        mallory = swarm.net.transport(C)  # C's own identity, as a hostile last hop would push
        got = {
            "skip": await _raw(mallory, A, *_ring_step(2, 4, 5)),
            "rewind": await _raw(mallory, A, *_ring_step(1, 1, 5)),
            "stop": await _raw(mallory, A, *_ring_step(1, 3, 2)),
        }
        got["ok"] = await _raw(mallory, A, *_ring_step(1, 3, 5))
        got["again"] = await _raw(mallory, A, *_ring_step(1, 3, 5))
        got["ok2"] = await _raw(mallory, A, *_ring_step(2, 4, 5))
        got["past"] = await _raw(mallory, A, *_ring_step(3, 5, 5))  # max_position 4
        for c in conns:
            await c.close()
        return got

    got = asyncio.run(main())
    for key in ("skip", "rewind", "stop", "again", "past"):
        assert isinstance(got[key], ErrorReply) and got[key].code == "bad_request", key
    assert isinstance(got["ok"], PushAck) and isinstance(got["ok2"], PushAck)


def test_the_ring_stops_at_a_stop_token_and_the_next_turn_goes_on(swarm):
    """EOS is a stop token of the ring: the last hop does not push past it (the client's wait
    ahead is answered RingStopped), and the next turn on the same pipeline starts a new ring."""
    route = [swarm.hops[A], swarm.hops[B], swarm.hops[C]]

    async def turns(push, eos):
        pipeline = Pipeline(swarm.net.transport("QmClient"), ChainListRoutes([route]), swarm.spec.model_id, 3, 64,
                            config=replace(CONFIG, push=push), vocab_size=swarm.spec.vocab_size)
        try:
            got = []
            prompt = [9, 8, 7]
            for _ in range(2):
                gen = Generation(pipeline, prompt, GenerationParams(max_new_tokens=8), eos)
                async for _ev in gen:
                    pass
                got.append((gen.result.tokens, gen.result.finish_reason))
                prompt = prompt + gen.result.tokens + [3]
            return got, pipeline.forwarding.ring_steps
        finally:
            await pipeline.close()

    async def main():
        plain, _ = await turns(PushConfig(), set())
        eos = {plain[0][0][4]}  # a token that comes first at index 4
        return plain, await turns(PushConfig(), eos), await turns(RING, eos)

    plain, (ref, _), (got, ring_steps) = asyncio.run(main())
    assert got == ref and ref[0] == (plain[0][0][:5], "stop") and ring_steps > 4


def test_the_ring_flag_maps_to_the_rule_with_a_ring():
    assert PushConfig.from_mode("ring") == PushConfig(enabled=True, ring=True)
    fixed = ("chat", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmA", "--push", "ring", "--verify-share", "0")
    assert client_from_args(build_parser("chat").parse_args(fixed)).config.push == PushConfig(enabled=True, ring=True)


def test_a_first_hop_that_hangs_on_ring_steps_is_named_by_the_last(model):
    """A silently drops the ring steps C pushes it (it stays up and answers the client): C's
    batch gets no ack in ``call_timeout_s``, so C ends its link to A and answers the client's
    wait naming A (unreachable), which is banned and routed around; the output is unchanged."""
    A2 = "QmPeerF"
    s = Swarm(model, {A: (0, 1), A2: (0, 1), B: (1, 2), C: (2, 3)},
              configs={C: dataclasses.replace(PEER, forwarding=ForwardingConfig(call_timeout_s=0.5))})
    try:
        honest = s.handlers[A].forwarder.push

        async def hang_on_ring_steps(msg, payload, stream, remote, run_local):
            if remote == C:
                await asyncio.sleep(3600)
            return await honest(msg, payload, stream, remote, run_local)

        s.handlers[A].forwarder.push = hang_on_ring_steps
        routes = ChainListRoutes([[s.hops[A], s.hops[B], s.hops[C]], [s.hops[A2], s.hops[B], s.hops[C]]])

        async def main():
            ref, _ = await _generate(s, ChainListRoutes([routes.chains[1]]), PushConfig(), [1, 2, 3], 6)
            got, p = await _generate(s, routes, RING, [1, 2, 3], 6)
            return ref, got, p

        ref, got, pipeline = asyncio.run(main())
        assert got == ref and [f.hop.peer_id for f in pipeline.failures] == [A]
        assert UNREACHABLE in pipeline.failures[0].reason
    finally:
        s.stop()


def test_a_peer_holding_the_whole_route_is_granted_a_loop_on_itself():
    loop = _grant(successor=PushHop("QmA", "sa"))
    check_grant(loop, "QmA", "QmA")
    with pytest.raises(BadRequestError):  # a loop is granted to its own peer only
        check_grant(loop, "QmB", "QmA")
    with pytest.raises(BadRequestError):  # a hop of a longer ring is never its own successor
        check_grant(_grant(successor=PushHop("QmA", "sa")), "QmB", "QmA")
    ring = RingState.of(loop, "QmA", "QmA")
    assert ring.loop and ring.last and not ring.first and ring.next_step == 3
    assert not RingState.of(loop, "QmPrev", "QmB").loop


def test_the_owners_credit_is_capped_past_the_step_it_waits_for():
    ring = RingState.of(_grant(max_position=10**6, successor=PushHop("QmA", "sa")), "QmA", "QmA")
    ring.resume(10**9, 5)
    assert ring.credit == 5 + MAX_RING_AHEAD


def test_a_ring_window_is_bounded():
    with pytest.raises(ConfigError):
        PushConfig(window=0)
    with pytest.raises(ConfigError):
        PushConfig(window=MAX_RING_AHEAD + 1)
    assert PushConfig(enabled=True, ring=True).use_push(1, verified=False)  # a loop, whatever the RTT


def test_a_ring_refused_at_its_first_hop_leaves_no_session_at_the_last(model):
    """The first hop refuses the ring's start (its KV is too small: ``overloaded``) while the
    client's wait for that step is already posted to the last hop. The client gives up and
    closes its sessions; the last hop, whose stream was blocked in that wait, sees the client
    hang up (``peer/read_ahead.py``) and frees its session then, not when the wait times out."""
    small = dataclasses.replace(PEER, kv_budget_token_layers=64)
    s = Swarm(model, {A: (0, 1), B: (1, 2), C: (2, 3)}, configs={A: small})
    try:
        route = [s.hops[A], s.hops[B], s.hops[C]]

        async def main():
            with pytest.raises(Exception) as refused:
                await _generate(s, ChainListRoutes([route]), RING, list(range(1, 41)), 2)
            for _ in range(100):  # the last hop notices the hang-up as the stream ends
                if not any(len(h.table) for h in s.handlers.values()):
                    break
                await asyncio.sleep(0.05)
            return refused.value, {pid: len(h.table) for pid, h in s.handlers.items()}

        error, held = asyncio.run(main())
        assert "overloaded" in str(error).lower() or "kv" in str(error).lower(), error
        assert held == {A: 0, B: 0, C: 0}
    finally:
        s.stop()


def test_log_probabilities_come_round_the_ring_as_they_come_back_driven(swarm):
    """A session that asks for each token's log-probability needs no per-step input from the
    client: it runs as a ring, and each step's reply carries the same log-probabilities as the
    driven route's."""
    routes = ChainListRoutes([[swarm.hops[A], swarm.hops[B], swarm.hops[C]]])
    sampling = SamplingParams(logprobs=True, top_logprobs=2)
    driven_replies, ringed_replies = [], []

    async def main():
        driven, _ = await _generate(swarm, routes, PushConfig(), [5, 6, 7, 8], 8, sampling=sampling,
                                    replies=driven_replies)
        ringed, p = await _generate(swarm, routes, RING, [5, 6, 7, 8], 8, sampling=sampling, replies=ringed_replies)
        return driven, ringed, p.forwarding.ring_steps

    driven, ringed, ring_steps = asyncio.run(main())
    assert ringed == driven and ring_steps == 7
    logprobs = [[msgspec.to_builtins(r.logprobs) for r in replies] for replies in (driven_replies, ringed_replies)]
    assert logprobs[1] == logprobs[0] and all(logprobs[1])


async def _penalised(s, route, push, sampling, prompt=(5, 6, 5, 6, 5)):
    """12 greedy tokens of a pipeline whose last hop applies ``sampling``'s penalties (driven
    steps carry their token ids), and its ring steps."""
    out, pipeline = await _generate(s, ChainListRoutes([route]), push, prompt, 12, sampling=sampling, extras=True)
    return out, pipeline.forwarding.ring_steps


@pytest.mark.parametrize("spans", [{A: (0, 1), B: (1, 2), C: (2, 3)}, {A: (0, 3)}], ids=["ring", "loop"])
def test_penalties_run_round_a_ring_with_the_history_the_last_hop_keeps(model, spans):
    """Penalties need the session's token history at the last hop. A ring's last hop gets the
    first step's token ids with its grant and keeps each token it samples, so a penalised
    session runs as a ring (or a loop) and picks the tokens the driven route picks."""
    s = Swarm(model, spans)
    sampling = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.8, presence_penalty=0.4)
    try:
        route = [s.hops[p] for p in spans]

        async def main():
            plain, _ = await _penalised(s, route, PushConfig(), SamplingParams())
            driven, _ = await _penalised(s, route, PushConfig(loop=False), sampling)
            ringed = await _penalised(s, route, RING, sampling)
            return plain, driven, ringed

        plain, driven, (ringed, ring_steps) = asyncio.run(main())
        assert driven != plain  # the penalties change the tokens, so the history matters
        assert ringed == driven and ring_steps == 11
    finally:
        s.stop()


def test_a_ring_context_is_the_last_hops_and_holds_the_first_steps_tokens():
    last = dict(successor=PushHop("QmA", "sa"))
    check_grant(_grant(context=[1, 2, 3, 4], **last), "QmB", "QmC")
    for bad in (_grant(context=[1, 2, 3]), _grant(context=[1, 2], **last),  # not the last hop; not 4 tokens
                _grant(context=[1, 2, 3, 4], route=[PushHop("QmB", "sb"), PushHop("QmC", "sc")])):
        with pytest.raises(BadRequestError, match="context"):
            check_grant(bad, "QmC", "QmX")
    ring = RingState.of(_grant(context=[9, 8, 7, 6], **last), "QmB")
    assert ring.context_of(_fwd(3, 10, n=4)) == [9, 8, 7, 6]
    assert ring.context_of(_fwd(4, 14)) is None  # no token pushed for it yet: refused downstream
    ring.fed = (4, 5)
    assert ring.context_of(_fwd(4, 14)) == [5] and RingState.of(_grant(**last), "QmB").context_of(_fwd(3, 10)) is None


def test_a_silent_middle_hop_is_found_by_driving_the_route_not_blamed_on_the_last(model):
    """B freezes mid-generation (it answers nothing, as a stopped process). The ring goes silent
    and the client cannot tell which hop stopped, so it blames nobody: it sets the ring's links
    aside and drives the route, whose call to B times out and names B. B is banned, the
    request goes on over B2 and the output is unchanged; C, the last hop, is not blamed."""
    B2 = "QmPeerE"
    s = Swarm(model, {A: (0, 1), B: (1, 2), B2: (1, 2), C: (2, 3)})
    frozen = asyncio.Event()
    try:
        honest = s.handlers[B]._dispatch

        async def freezable(msg, payload, stream):
            if frozen.is_set():
                await asyncio.sleep(3600)
            return await honest(msg, payload, stream)

        s.handlers[B]._dispatch = freezable
        routes = ChainListRoutes([[s.hops[A], s.hops[B], s.hops[C]], [s.hops[A], s.hops[B2], s.hops[C]]])
        fast = dataclasses.replace(CONFIG, hop_timeout_s=1.0)

        async def main():
            ref, _ = await _generate(s, ChainListRoutes([routes.chains[1]]), PushConfig(), [1, 2, 3], 8)
            got, p = await _generate(s, routes, RING, [1, 2, 3], 8, kill_after=(3, frozen.set), config=fast)
            return ref, got, p

        ref, got, pipeline = asyncio.run(main())
        assert got == ref and [f.hop.peer_id for f in pipeline.failures] == [B]
        assert pipeline.route[1].peer_id == B2
    finally:
        s.stop()


def test_an_earlier_hops_unasked_replies_are_kept_by_step_and_anything_else_is_its_failure():
    """What an earlier hop sends on its stream during a ring: its replies, kept by step until
    the client reads them; an ErrorReply, another message, or more replies than a ring can run
    ahead of the client are that hop's error."""
    from types import SimpleNamespace

    from p2pserve.client.ring import RingRoute
    from p2pserve.errors import P2PServeError

    links = [SimpleNamespace(hop=SimpleNamespace(peer_id=p)) for p in ("A", "B", "C")]
    ring = RingRoute(links)  # type: ignore[arg-type]
    result = lambda step: msgspec.structs.replace(_RESULT, step=step)  # noqa: E731
    ring._keep(1, result(4), b"x")
    ring._keep(1, result(5), b"y")
    assert ring._reports[1] == {4: (result(4), b"x"), 5: (result(5), b"y")} and ring._reports[0] == {}
    with pytest.raises(MalformedFrameError):
        ring._keep(0, PushAck(session_id="s", step=3), b"")
    with pytest.raises(P2PServeError):
        ring._keep(0, ErrorReply(code="internal", message="no"), b"")
    with pytest.raises(MalformedFrameError):
        for step in range(MAX_RING_AHEAD + 2):
            ring._keep(0, result(step), b"")


_RESULT = ForwardResult(session_id="s", step=0, position=1, token=3)
