"""Push mode: the wire structs' bounds, the peer's route checks, and hostile pushes.

Three real peer handlers, each holding one layer of a real tiny Llama (real shards and compute
workers), run on an in-memory transport; each finds the next hop's addresses in its own view of
an in-memory swarm (``FakeSwarm``, with the real reader's identity rules). Greedy output pushed
peer to peer equals client-driven output, the token coming from the last hop's AwaitResult; a
route naming an unknown session, another owner's session, or a peer twice gets a typed error
naming the hop at fault; a route carrying addresses, or naming a peer the forwarding peer has no
record of, is refused without dialling anything; a peer the owner did not allow cannot push into
a session; and a dead next hop is reported back, banned and routed around with the output unchanged.
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
from p2pserve.client.pipeline import Pipeline
from p2pserve.config import PushConfig
from p2pserve.client.route_providers import ChainListRoutes
from p2pserve.config import ClientConfig
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.records import PeerInfo
from p2pserve.errors import BadRequestError, ConfigError, MalformedFrameError
from p2pserve.peer.next_hop import check_route
from p2pserve.config import ForwardingConfig
from p2pserve.peer.next_hop import AnnouncedAddresses
from p2pserve.peer.next_hop import UNREACHABLE
from p2pserve.protocol import (
    FRAME_PREFIX,
    MAX_PUSH_HOPS,
    SESSION_PROTOCOL,
    AllowPush,
    AwaitResult,
    ErrorReply,
    Forward,
    FrameLimits,
    PushAck,
    PushForward,
    PushHop,
    SamplingParams,
    decode_reply,
    decode_request,
)
from p2pserve.transport.frames import read_frame, tensor_to_wire, write_frame
from p2pserve.testing.swarm import FakeSwarm, FakeSwarmStore
from tests.push_swarm import (  # noqa: F401 (model, swarm: fixtures)
    A,
    B,
    C,
    C2,
    CONFIG,
    PEER,
    SPANS,
    Swarm,
    _generate,
    _open,
    _raw,
    model,
    swarm,
)

PUSH = PushConfig(enabled=True, min_rtt_ms=0)  # pushed whatever the links


def _encode(msg) -> bytes:
    return msgspec.msgpack.encode(msg)


def test_a_route_longer_than_the_bound_is_refused_by_the_decoder():
    meta, _ = tensor_to_wire(torch.tensor([1], dtype=torch.int64))
    fwd = Forward(session_id="s", step=0, position=0, tensor=meta)
    hops = [PushHop(peer_id="Qm" + "z" * i, session_id=f"s{i}") for i in range(1, MAX_PUSH_HOPS + 2)]
    ok = PushForward(forward=fwd, route=hops[:MAX_PUSH_HOPS])
    assert decode_request(_encode(ok)) == ok
    with pytest.raises(MalformedFrameError):
        decode_request(_encode(PushForward(forward=fwd, route=hops)))


@pytest.mark.parametrize("hop", [
    {"peer_id": "not a peer id!", "session_id": "s"},  # outside base58
    {"peer_id": "Qm" + "a" * 200, "session_id": "s"},  # too long
    {"peer_id": "QmX", "session_id": ""},  # empty session id
    {"peer_id": "QmX", "session_id": "s", "maddrs": ["/ip4/127.0.0.1/tcp/1/p2p/QmX"]},  # addresses: never taken
])
def test_hostile_hops_are_refused_by_the_decoder(hop):
    meta, _ = tensor_to_wire(torch.tensor([1], dtype=torch.int64))
    raw = {"t": "push_forward", "forward": {"t": "forward", "session_id": "s", "step": 0, "position": 0,
                                            "tensor": msgspec.to_builtins(meta)}, "route": [hop]}
    with pytest.raises(MalformedFrameError):
        decode_request(msgspec.msgpack.encode(raw))


@pytest.mark.parametrize("grant", [{"session_id": "s", "from_peer": "not a peer id!"},
                                   {"session_id": "", "from_peer": "QmX"},
                                   {"session_id": "s" * 129, "from_peer": "QmX"}])
def test_hostile_grants_are_refused_by_the_decoder(grant):
    with pytest.raises(MalformedFrameError):
        decode_request(msgspec.msgpack.encode({"t": "allow_push", **grant}))


def test_the_rule_pushes_enabled_slow_unverified_routes_only():
    slow, fast = [0.06, 0.05, 0.07], [0.002, 0.001, 0.003]
    assert not PushConfig().use_push(3, False, slow)  # off by default
    on = PushConfig(enabled=True)
    assert on.use_push(3, False, slow) and not on.use_push(3, False, fast)
    assert not on.use_push(3, True, slow)  # verified outputs stay client-driven
    assert not on.use_push(MAX_PUSH_HOPS + 2, False, slow)
    # one hop: a loop on that peer (verified or not), unless the loop is off
    assert on.use_push(1, True, fast[:1]) and not PushConfig(loop=False).use_push(1, False, slow[:1])
    assert not on.use_push(3, False, [None, None, None]) and PUSH.use_push(3, False, fast)
    assert not PushConfig(enabled=True, min_hops=1, min_rtt_ms=0, loop=False).use_push(1, False, slow[:1])  # one hop: only as a loop


def test_the_push_flag_maps_to_the_rule():
    assert PushConfig.from_mode("off") == PushConfig()
    assert PushConfig(enabled=True, min_rtt_ms=0).use_push(2, False, [0.0, 0.0])  # a chain: the library's
    for retired in ("sometimes", "auto", "on"):  # the chain is no mode of the commands: rings beat it
        with pytest.raises(ConfigError):
            PushConfig.from_mode(retired)
    assert ClientConfig().push == PushConfig.from_mode("ring") and ClientConfig(push=PUSH, verify_share=0).push is PUSH
    with pytest.raises(ConfigError):  # a verified route is never pushed: refused, not silently client-driven
        ClientConfig(push=PushConfig(enabled=True))
    for command in ("chat", "api"):
        fixed = (command, "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmA")
        # the commands run rings by default (verified or not), as the Python client does
        assert client_from_args(build_parser(command).parse_args(fixed)).config.push == PushConfig.from_mode("ring")
        off = build_parser(command).parse_args([*fixed, "--push", "off"])
        assert client_from_args(off).config.push == PushConfig()
        with pytest.raises(SystemExit):  # argparse refuses a retired mode
            build_parser(command).parse_args([*fixed, "--push", "on"])


def test_announced_addresses_are_the_peers_own_and_re_read_sparingly():
    """Only a record signed by the peer it names gives addresses; a miss re-reads the swarm at
    most every ``miss_refresh_s``, a hit every ``refresh_s``."""
    store, now = FakeSwarmStore(), [0.0]
    store.put(RecordKind.PEERS, f"key-{B}", PeerInfo(model="tiny", peer_id=B, addrs=["/ip4/10.0.0.2/tcp/1"]))
    store.put(RecordKind.PEERS, f"key-{A}", PeerInfo(model="tiny", peer_id=C, addrs=["/ip4/127.0.0.1/tcp/2"]))
    view = FakeSwarm(store, name=A)
    addresses = AnnouncedAddresses(view, refresh_s=10.0, miss_refresh_s=0.5, clock=lambda: now[0])

    async def main():
        got = [await addresses(B), await addresses(C), await addresses(C)]
        now[0] = 1.0
        got.append(await addresses(C))  # a miss, later: read again
        got.append(await addresses(B))  # a hit: not read again
        return got

    assert asyncio.run(main()) == [("/ip4/10.0.0.2/tcp/1",), (), (), (), ("/ip4/10.0.0.2/tcp/1",)]
    assert view.calls["get_peers"] == 2


def test_check_route_refuses_repeats_and_this_peer():
    check_route([PushHop(B, "s1"), PushHop(C, "s2")], A)
    with pytest.raises(BadRequestError, match="twice"):
        check_route([PushHop(B, "s1"), PushHop(B, "s2")], A)
    with pytest.raises(BadRequestError, match="twice"):
        check_route([PushHop(B, "s1"), PushHop(A, "s2")], A)
    with pytest.raises(BadRequestError, match="session twice"):
        check_route([PushHop(B, "s1"), PushHop(C, "s1")], A)


def test_pushed_greedy_output_equals_client_driven(swarm):
    route = [swarm.hops[A], swarm.hops[B], swarm.hops[C]]

    async def main():
        driven, _ = await _generate(swarm, ChainListRoutes([route]), PushConfig(), [5, 6, 7, 8], 8)
        pushed, p = await _generate(swarm, ChainListRoutes([route]), PUSH, [5, 6, 7, 8], 8)
        return driven, pushed, p

    driven, pushed, pipeline = asyncio.run(main())
    assert pushed == driven and not pipeline.failures
    assert swarm.handlers[B].forwarder._links  # A -> ... really went peer to peer (B forwarded to C)


def test_pushed_seeded_sampling_reproduces_client_driven_with_a_failure(swarm):
    sampling = SamplingParams(temperature=1.0, top_k=50, seed=7)
    routes = [[swarm.hops[A], swarm.hops[B], swarm.hops[C]], [swarm.hops[A], swarm.hops[B], swarm.hops[C2]]]

    async def main():
        ref, _ = await _generate(swarm, ChainListRoutes([routes[1]]), PushConfig(), [2, 7, 1], 8, sampling=sampling)
        got, p = await _generate(swarm, ChainListRoutes(routes), PUSH, [2, 7, 1], 8, (4, C), sampling)
        return ref, got, p

    ref, got, pipeline = asyncio.run(main())
    assert got == ref and len(pipeline.failures) == 1


def test_a_pushed_verification_step_carries_outputs_to_the_last_hop(swarm):
    """Speculative verification (``outputs`` > 1) through push: the hops before the last run with
    1, the last returns one token per verified position, as client-driven."""
    route = [swarm.hops[A], swarm.hops[B], swarm.hops[C]]

    async def verify(push):
        pipeline = Pipeline(swarm.net.transport("QmClient"), ChainListRoutes([route]), swarm.spec.model_id, 3, 64,
                            config=replace(CONFIG, push=push), vocab_size=swarm.spec.vocab_size)
        try:
            return await pipeline.verify([4, 5, 6, 7, 8], outputs=3)
        finally:
            await pipeline.close()

    async def main():
        return await verify(PushConfig()), await verify(PUSH)

    driven, pushed = asyncio.run(main())
    assert len(pushed) == 3 and pushed == driven


def test_a_link_closed_while_idle_is_reopened_not_blamed(swarm):
    """The next peer closes a stream that held no session after its idle timeout: the forwarding
    peer opens a new one instead of reporting the next hop as failed."""
    route = [swarm.hops[A], swarm.hops[B], swarm.hops[C]]

    def close_links():
        links = [link for h in swarm.handlers.values() for link in h.forwarder._links.values()]
        assert len(links) == 2  # A -> B and B -> C
        for link in links:
            link.stream.close()

    async def main():
        ref, _ = await _generate(swarm, ChainListRoutes([route]), PushConfig(), [9, 8, 7], 8)
        got, p = await _generate(swarm, ChainListRoutes([route]), PUSH, [9, 8, 7], 8, (3, close_links))
        return ref, got, p

    ref, got, pipeline = asyncio.run(main())
    assert got == ref and not pipeline.failures


def test_a_dead_next_hop_is_reported_banned_and_routed_around(swarm):
    routes = ChainListRoutes([[swarm.hops[A], swarm.hops[B], swarm.hops[C]],
                              [swarm.hops[A], swarm.hops[B], swarm.hops[C2]]])

    async def main():
        ref, _ = await _generate(swarm, ChainListRoutes([routes.chains[1]]), PushConfig(), [3, 1, 4], 8)
        got, p = await _generate(swarm, routes, PUSH, [3, 1, 4], 8, kill_after=(3, C))
        return ref, got, p

    ref, got, pipeline = asyncio.run(main())
    assert got == ref
    assert [f.hop.peer_id for f in pipeline.failures] == [C]  # B named C; the client banned C, not A
    assert pipeline.route[-1].peer_id == C2


class _DaemonRefuses:
    """A transport whose dials to ``dead`` fail as the libp2p daemon's do: not with ConnectionError."""

    def __init__(self, inner, dead: str):
        self.inner, self.dead = inner, dead

    async def open_stream(self, peer_id, maddrs, protocol, timeout_s):
        if peer_id == self.dead:
            raise RuntimeError("ControlFailure: failed to dial: all dials failed")
        return await self.inner.open_stream(peer_id, maddrs, protocol, timeout_s)


def test_a_next_hop_its_predecessor_cannot_dial_is_driven_not_banned(swarm):
    """Any error dialling the next hop (the daemon raises its own ControlFailure) is told as one
    "unreachable" that names it; the client sets that link aside and drives the route itself,
    and since it reaches the hop, nobody is banned: a peer cannot get its successor excluded by
    calling it unreachable."""
    routes = ChainListRoutes([[swarm.hops[A], swarm.hops[B], swarm.hops[C]],
                              [swarm.hops[A], swarm.hops[B], swarm.hops[C2]]])
    forwarder = swarm.handlers[B].forwarder
    forwarder.dialer.transport = _DaemonRefuses(forwarder.dialer.transport, C)

    async def main():
        ref, _ = await _generate(swarm, ChainListRoutes([routes.chains[1]]), PushConfig(), [3, 1, 4], 6)
        got, p = await _generate(swarm, routes, PUSH, [3, 1, 4], 6)
        return ref, got, p

    ref, got, pipeline = asyncio.run(main())
    assert got == ref and not pipeline.failures and pipeline.forwarding.pushed_steps == 0
    assert pipeline.state.unlinked.active() == {f"{B}>{C}"} and not pipeline.state.bans.active()
    assert [h.peer_id for h in pipeline.route_log[-1]] == [A, B, C]  # the same route, driven


def test_a_hung_hop_is_named_by_its_predecessor_not_blamed_on_the_first(model):
    """Timeouts shrink along the chain (one ``call_timeout_s`` per hop still to run): when the last
    hop hangs, its predecessor times out first and names it."""
    short = dataclasses.replace(PEER, forwarding=ForwardingConfig(call_timeout_s=0.5))
    swarm = Swarm(model, SPANS, configs={A: short, B: short})
    try:
        routes = ChainListRoutes([[swarm.hops[A], swarm.hops[B], swarm.hops[C]],
                                  [swarm.hops[A], swarm.hops[B], swarm.hops[C2]]])

        async def hang(*_args):
            await asyncio.sleep(3600)

        swarm.handlers[C].forwarder.push = hang  # fault injection: C takes pushes and never answers

        async def main():
            ref, _ = await _generate(swarm, ChainListRoutes([routes.chains[1]]), PushConfig(), [2, 2, 2], 4)
            got, p = await _generate(swarm, routes, PUSH, [2, 2, 2], 4)
            return ref, got, p

        ref, got, pipeline = asyncio.run(main())
        # a timeout, told like any other failure to reach it: B names C, and the route is driven
        assert got == ref and not pipeline.failures and pipeline.state.unlinked.active() == {f"{B}>{C}"}
    finally:
        swarm.stop()


def test_hostile_routes_get_typed_errors_naming_the_hop(swarm):
    async def main():
        a = await _open(swarm, "QmClient", A, "sa")
        b = await _open(swarm, "QmClient", B, "sb")
        await _open(swarm, "QmEve", B, "victim-of-nobody")  # another client's session on B
        await b.call(AllowPush(session_id="sb", from_peer=A))
        meta, data = tensor_to_wire(torch.tensor([1, 2], dtype=torch.int64))

        async def push(route):
            """A PushForward on the client's own stream to A; the raw reply (with ``failed_peer``)."""
            fwd = Forward(session_id="sa", step=0, position=0, tensor=meta)
            await write_frame(a.stream.writer, PushForward(forward=fwd, route=route), data)
            header, _ = await read_frame(a.stream.reader, FrameLimits())
            return decode_reply(header)

        unknown = await push([PushHop(B, "never-opened")])
        # another owner's session on B: A was never allowed into it, and it does not exist for A
        foreign = await push([PushHop(B, "victim-of-nobody")])
        twice = await push([PushHop(B, "sb"), PushHop(B, "sc")])
        fine = await push([PushHop(B, "sb")])  # B, the route's last hop, acks; its output is the owner's
        result, _ = await b.call(AwaitResult(session_id="sb", step=0))  # held for the owner until asked
        return unknown, foreign, twice, fine, result

    unknown, foreign, twice, fine, result = asyncio.run(main())
    for err in (unknown, foreign):
        assert isinstance(err, ErrorReply) and err.code == "unknown_session" and err.failed_peer == B
    assert foreign.message.replace("victim-of-nobody", "X") == unknown.message.replace("never-opened", "X")
    # refused by A itself before any work: failed_peer None (the hop answering is at fault)
    assert twice.code == "bad_request" and "twice" in twice.message and twice.failed_peer is None
    assert isinstance(fine, PushAck) and fine.session_id == "sa" and fine.step == 0
    assert result.tensor is not None and result.position == 2 and result.session_id == "sb"


def test_a_route_cannot_make_a_peer_dial_where_the_client_says(swarm):
    """The SSRF a route with addresses allowed: a client could make a peer dial any host. Now a
    hop carrying addresses is refused by the decoder, and a hop naming a peer the forwarding peer
    holds no self-signed record of (a record another peer put up for it does not count) gets a
    typed error naming it, with nothing dialled: the peer exists on the network and sees no stream."""
    dialled = []

    async def mallory(reader, writer, remote):
        dialled.append(remote)
        writer.close()

    mallory_id = "QmMa11ory"
    swarm.net.serve(mallory_id, SESSION_PROTOCOL, mallory)
    swarm.records.put(RecordKind.PEERS, f"key-{B}", PeerInfo(model="tiny", peer_id=mallory_id,
                                                            addrs=[f"/memory/p2p/{mallory_id}"]))

    async def main():
        a = await _open(swarm, "QmClient", A, "sa")
        meta, data = tensor_to_wire(torch.tensor([1, 2], dtype=torch.int64))
        fwd = Forward(session_id="sa", step=0, position=0, tensor=meta)
        raw = {**msgspec.to_builtins(PushForward(forward=fwd)),
               "route": [{"peer_id": mallory_id, "session_id": "s", "maddrs": [f"/ip4/127.0.0.1/tcp/1/p2p/{mallory_id}"]}]}
        replies = []
        for frame in (msgspec.msgpack.encode(raw), PushForward(forward=fwd, route=[PushHop(mallory_id, "s")])):
            if isinstance(frame, bytes):  # a hand-made header: the prefix and payload as write_frame lays them out
                a.stream.writer.write(FRAME_PREFIX.pack(len(frame), len(data)) + frame + data)
            else:
                await write_frame(a.stream.writer, frame, data)
            header, _ = await read_frame(a.stream.reader, FrameLimits())
            replies.append(decode_reply(header))
        return replies

    with_addresses, unannounced = asyncio.run(main())
    assert isinstance(with_addresses, ErrorReply) and with_addresses.code == "malformed"
    assert isinstance(unannounced, ErrorReply) and unannounced.code == "internal"
    assert unannounced.failed_peer == mallory_id and unannounced.message == UNREACHABLE
    assert dialled == []


def test_only_the_allowed_peer_can_push_and_only_the_owner_can_allow(swarm):
    async def main():
        await _open(swarm, "QmClient", A, "sa")
        b = await _open(swarm, "QmClient", B, "sb")
        meta, data = tensor_to_wire(torch.zeros(1, swarm.spec.hidden_size))
        fwd = PushForward(forward=Forward(session_id="sb", step=0, position=0, tensor=meta))
        before = await _raw(swarm.net.transport(A), B, fwd, data)  # A not allowed yet
        stranger = await _raw(swarm.net.transport("QmEve"), B, AllowPush(session_id="sb", from_peer="QmEve"))
        await b.call(AllowPush(session_id="sb", from_peer=A))
        eve = await _raw(swarm.net.transport("QmEve"), B, fwd, data)
        allowed = await _raw(swarm.net.transport(A), B, fwd, data)
        eve_waits = await _raw(swarm.net.transport("QmEve"), B, AwaitResult(session_id="sb", step=0))
        result, _ = await b.call(AwaitResult(session_id="sb", step=0))
        return before, stranger, eve, allowed, eve_waits, result

    before, stranger, eve, allowed, eve_waits, result = asyncio.run(main())
    assert before.code == stranger.code == eve.code == eve_waits.code == "unknown_session"
    assert isinstance(allowed, PushAck) and result.tensor is not None and result.position == 1


def test_one_client_cannot_use_up_a_forwarding_peers_allowance_at_the_next_hop(model):
    """A client opening many sessions on A and B and pushing each once made A open a stream to B
    per session, all counted against A at B, until A's allowance there was gone and an honest
    client's push through A failed (B blamed). A forwarded stream now counts against the client
    whose session it pushes into: the attacker's own pushes are refused once it is at its bound
    (a typed error, its own), A holds nothing at B, and the honest client's push goes through."""
    from p2pserve.config import AdmissionConfig

    cap = 4
    tight = dataclasses.replace(PEER, admission=AdmissionConfig(max_streams_per_owner=cap))
    swarm = Swarm(model, {A: (0, 1), B: (1, 2)}, configs={B: tight})

    async def route(client, i):
        a = await _open(swarm, client, A, f"{client}-a{i}")
        b = await _open(swarm, client, B, f"{client}-b{i}")
        await b.call(AllowPush(session_id=b.session_id, from_peer=A))
        return a, b

    async def push(a, b):
        meta, data = tensor_to_wire(torch.tensor([1, 2], dtype=torch.int64))
        fwd = Forward(session_id=a.session_id, step=0, position=0, tensor=meta)
        await a.send(PushForward(forward=fwd, route=[PushHop(B, b.session_id)]), data)
        reply, _ = await a.read()  # an ErrorReply as it came (``call`` would raise it)
        return reply, (a, b)

    async def main():
        routes = [await route("QmMa11ory", i) for i in range(cap)]  # its own streams at B: its bound
        mallory = [await push(*r) for r in routes]
        honest = [await push(*await route("QmHonest", i)) for i in range(2)]
        held_by_a = swarm.handlers[B].quota.by_owner[A]
        for _, conns in mallory + honest:
            for c in conns:
                await c.close()
        return [r for r, _ in mallory], [r for r, _ in honest], held_by_a

    try:
        mallory, honest, held_by_a = asyncio.run(main())
    finally:
        swarm.stop()
    assert all(isinstance(r, ErrorReply) and r.code == "overloaded" and r.failed_peer == B for r in mallory), mallory
    assert all(isinstance(r, PushAck) for r in honest), honest
    assert held_by_a == 0
