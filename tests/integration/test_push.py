"""Push mode with real peer processes: steps forwarded peer to peer over libp2p / the direct path.

Five `p2pserve peer` processes on the tiny Llama: [0:3), [3:6) and three replicas of [6:8), each
behind a delay relay adding 25 ms each way (``p2pserve/testing/wan.py``), so every link, client to
peer and peer to peer, is a slow one. They meet at a bootstrap node and announce the relays'
addresses, where each finds the next hop of a pushed step (the route names peer ids only). The
client opens a session on each hop of a 3-hop route, allows each hop's predecessor into it, sends
each step to the first hop and waits for the token at the last (AwaitResult). Greedy output must
equal `generate`, also when the route's last peer is SIGKILLed mid-generation (the client's wait
on it breaks, or its predecessor reports it unreachable and the client, driving the route, fails
to reach it too: the client bans it, re-routes to the replica and replays). The route is pushed by the rule itself (``PushConfig(enabled=True)``: the
sessions' open round trips are over its 10 ms).
A route cannot make a peer dial an address of the client's choosing (a listener sees nothing).
Ring mode (``client/ring.py``) too: greedy output equal to `generate`, with and without its last
peer SIGKILLed mid-generation, and seeded sampling equal to client-driven.
"""

from __future__ import annotations

from dataclasses import replace

import asyncio
import socket
import time

import msgspec
import pytest
import torch

from p2pserve.client.api import AsyncClient
from p2pserve.client.connection import HopConnection
from p2pserve.client.failover import FailoverState
from p2pserve.client.generation import Generation
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.client.params import GenerationParams
from p2pserve.client.pipeline import Pipeline
from p2pserve.client.route_providers import ChainListRoutes
from p2pserve.config import ClientConfig, PushConfig
from p2pserve.errors import BadRequestError
from p2pserve.peer.next_hop import UNREACHABLE
from p2pserve.protocol import (
    FRAME_PREFIX,
    AllowPush,
    ErrorReply,
    Forward,
    ForwardResult,
    GetStats,
    PeerStats,
    PushBatch,
    PushBatchAck,
    PushForward,
    PushHop,
    SamplingParams,
    decode_reply,
)
from p2pserve.testing.wan import announced_swarm
from p2pserve.transport.frames import read_frame, tensor_to_wire, write_frame
from tests.harness import client_node, reference_generate

pytestmark = pytest.mark.integration

RANGES = [(0, 3), (3, 6), (6, 8), (6, 8), (6, 8)]  # three replicas of the last hop: two of them die
CONFIG = ClientConfig(hop_timeout_s=60.0, max_retries=3, ban_base_s=30.0, verify_share=0.0)
GREEDY = GenerationParams(max_new_tokens=12, ignore_eos=True)
RING = PushConfig(enabled=True, ring=True)  # pushed by the rule (slow links), as a ring
_BOOT: list[str] = []  # the cluster's bootstrap multiaddrs


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    path = model_dir("llama")
    tmp = tmp_path_factory.mktemp("push")
    with announced_swarm(path, RANGES, delay_ms=25.0, workdir=tmp, num_layers=8) as (boot, relayed):
        _BOOT[:] = boot  # where a test's own DHT node joins (an attacker's record)
        yield path, [rp.peer for rp in relayed]


async def _generate(path, peers, prompt_ids, kill_after: int | None = None, params: GenerationParams = GREEDY,
                    push: PushConfig = PushConfig(enabled=True), lasts: tuple[int, ...] = (2, 3)):
    """Generation over the chains [A, B, peers[i]] for i in ``lasts``, in order, pushed when
    ``push`` says so; kills the first chain's last peer after ``kill_after`` tokens. Returns
    (tokens, pipeline)."""
    model = LocalModelInfo.load(path)
    a, b = peers[:2]
    routes = ChainListRoutes([[a.hop(), b.hop(), peers[i].hop()] for i in lasts])
    async with client_node(CONFIG) as transport:
        pipeline = Pipeline(transport, routes, model.spec.model_id, model.spec.num_layers, 256, params.validate(),
                            replace(CONFIG, push=push), FailoverState(CONFIG), vocab_size=model.spec.vocab_size)
        gen = Generation(pipeline, prompt_ids, params, model.eos_ids)
        try:
            n = 0
            async for _ in gen:
                n += 1
                if n == kill_after:
                    await asyncio.to_thread(peers[lasts[0]].kill)
            return gen.result.tokens, pipeline
        finally:
            await pipeline.close()


def _prompt(path, text):
    return LocalModelInfo.load(path).chat_ids([{"role": "user", "content": text}])


def test_a_hostile_record_gets_the_same_answer_whatever_its_addresses_hold(cluster):
    """A port scan through a forwarding peer: an attacker announces records of its own (signed by
    fresh keys, as any member may), whose addresses are a closed port and a listener that hangs up,
    and pushes a step to each through an honest peer. The peer dials what each record announced
    (the listener sees it), and answers both, and a peer id nobody announced, with one error: the
    same code and message, so the client learns nothing of what was there (before: "connection
    refused" against an EOF).

    Each attacker identity announces and then shuts its DHT node down: a live node would leave
    the peer's libp2p daemon another way to that id (a connection its DHT traffic opened, the
    address its identify reported), and the dial could end there instead of at the record's
    address, whenever the machine's timing favoured it."""
    from p2pserve.config import DHTConfig

    from p2pserve.dht.records import PeerInfo
    from p2pserve.dht.swarm import Swarm
    from p2pserve.model.identity import derived_name

    path, peers = cluster
    model = LocalModelInfo.load(path)
    seen = []
    # records that live 3 s: within what a peer of this swarm accepts (2 s TTL + 2 s skew)
    dht = DHTConfig(model=derived_name(path), initial_peers=tuple(_BOOT), client_mode=True,
                    host_maddrs=("/ip4/127.0.0.1/tcp/0",), num_layers=8, peer_refresh=1.5, max_clock_skew=2.0)

    async def announce_and_leave(port: int) -> str:
        """A fresh identity's record pointing at ``port``, its node gone once it is stored."""
        node = await asyncio.to_thread(Swarm.create, dht)
        try:
            info = PeerInfo(model=derived_name(path), peer_id=node.peer_id, num_layers=8,
                            timestamp=time.time(), addrs=[f"/ip4/127.0.0.1/tcp/{port}/p2p/{node.peer_id}"])
            await node.announce_peer(info)  # best effort: the loop retries
            return node.peer_id
        finally:
            node.shutdown()

    async def main():
        listener = await asyncio.start_server(lambda r, w: (seen.append(1), w.close()), "127.0.0.1", 0)
        hangs_up = listener.sockets[0].getsockname()[1]
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        refused = closed.getsockname()[1]
        closed.close()  # nothing listens there now
        replies: dict[str, ErrorReply] = {}
        targets: dict[str, str] = {}
        async with client_node(CONFIG) as transport:
            conn = HopConnection(transport, peers[0].hop(), CONFIG.frame_limits, 60.0)
            await conn.open(model.spec.model_id, None, 64, SamplingParams())
            meta, data = tensor_to_wire(torch.tensor([1, 2, 3], dtype=torch.int64))
            fwd = Forward(session_id=conn.session_id, step=0, position=0, tensor=meta)
            deadline = time.monotonic() + 120.0
            while time.monotonic() < deadline:  # until the first peer's view holds a record (it dialled)
                targets = {"refused": await announce_and_leave(refused), "hangs_up": await announce_and_leave(hangs_up),
                           "nobody": transport.peer_id}
                for _ in range(4):  # the peer re-reads the DHT on a miss, at most every 0.5 s
                    for name, pid in targets.items():
                        await write_frame(conn.stream.writer, PushForward(forward=fwd, route=[PushHop(pid, "s")]), data)
                        replies[name] = decode_reply((await read_frame(conn.stream.reader, CONFIG.frame_limits))[0])
                    if seen:
                        break
                    await asyncio.sleep(0.5)
                if seen:
                    break
            await conn.close()
        listener.close()
        return replies, targets

    replies, targets = asyncio.run(main())
    assert seen, ("the first peer never dialled the address the record announced", replies)
    for name, reply in replies.items():
        assert isinstance(reply, ErrorReply) and reply.failed_peer == targets[name], (name, reply)
    assert {(r.code, r.message) for r in replies.values()} == {("internal", UNREACHABLE)}, replies


def test_pushed_greedy_output_is_token_identical(cluster):
    path, peers = cluster
    ids = _prompt(path, "Forward it peer to peer, please.")
    tokens, pipeline = asyncio.run(_generate(path, peers, ids))
    assert tokens == reference_generate(path, ids, GREEDY.max_new_tokens)
    assert not pipeline.failures and len(pipeline.route_log) == 1
    assert pipeline.forwarding.pushed_steps == GREEDY.max_new_tokens  # the rule chose push for every step


def test_seeded_sampling_pushed_reproduces_client_driven(cluster):
    path, peers = cluster
    ids = _prompt(path, "Pick your words at random, but the same ones twice.")
    sampled = GenerationParams(max_new_tokens=8, ignore_eos=True, temperature=1.0, top_k=50, seed=11)
    driven, _ = asyncio.run(_generate(path, peers, ids, params=sampled, push=PushConfig(), lasts=(3,)))
    pushed, pipeline = asyncio.run(_generate(path, peers, ids, params=sampled, lasts=(3,)))
    assert pushed == driven and pipeline.forwarding.pushed_steps == sampled.max_new_tokens
    ringed, pipeline = asyncio.run(_generate(path, peers, ids, params=sampled, push=RING, lasts=(3,)))
    assert ringed == driven and pipeline.forwarding.ring_steps == sampled.max_new_tokens - 1


def test_ringed_greedy_output_is_token_identical(cluster):
    """Ring mode: after the first step the last hop pushes each token to the first hop itself."""
    path, peers = cluster
    ids = _prompt(path, "Round and round the ring it goes.")
    tokens, pipeline = asyncio.run(_generate(path, peers, ids, push=RING, lasts=(3,)))
    assert tokens == reference_generate(path, ids, GREEDY.max_new_tokens)
    assert not pipeline.failures and pipeline.forwarding.ring_steps == GREEDY.max_new_tokens - 1


def test_a_peer_killed_mid_ring_is_reported_and_routed_around(cluster):
    """The ring's last peer dies: the client's wait on it breaks (or the hop before it reports
    it): the client bans it, re-routes to a replica and replays; the output is unchanged."""
    path, peers = cluster
    ids = _prompt(path, "Even when the ring breaks on the way.")
    tokens, pipeline = asyncio.run(_generate(path, peers, ids, kill_after=5, push=RING, lasts=(4, 3)))
    assert tokens == reference_generate(path, ids, GREEDY.max_new_tokens)
    assert [f.hop.peer_id for f in pipeline.failures] == [peers[4].peer_id]
    assert pipeline.route[-1].peer_id == peers[3].peer_id and pipeline.forwarding.ring_steps > 5


def test_a_route_cannot_make_a_peer_dial_a_host_of_the_clients_choosing(cluster):
    """The attack a route with addresses allowed: a client naming 127.0.0.1:<port> as the next hop
    made the first peer open a TCP connection there. A hop with addresses is now refused by the
    decoder, and a peer id the first peer holds no record of (the client's own) is reported as
    unreachable without dialling: both typed errors; the listener sees no connection."""
    path, peers = cluster
    model = LocalModelInfo.load(path)
    seen = []

    async def main():
        listener = await asyncio.start_server(lambda r, w: (seen.append(1), w.close()), "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        async with client_node(CONFIG) as transport:
            conn = HopConnection(transport, peers[0].hop(), CONFIG.frame_limits, 30.0)
            await conn.open(model.spec.model_id, None, 64, SamplingParams())
            meta, data = tensor_to_wire(torch.tensor([1, 2, 3], dtype=torch.int64))
            fwd = Forward(session_id=conn.session_id, step=0, position=0, tensor=meta)
            me = transport.peer_id  # a real peer id, never announced as a peer
            hostile = {**msgspec.to_builtins(PushForward(forward=fwd)),
                       "route": [{"peer_id": me, "session_id": "s", "maddrs": [f"/ip4/127.0.0.1/tcp/{port}/p2p/{me}"]}]}
            header = msgspec.msgpack.encode(hostile)
            conn.stream.writer.write(FRAME_PREFIX.pack(len(header), len(data)) + header + data)
            replies = [decode_reply((await read_frame(conn.stream.reader, CONFIG.frame_limits))[0])]
            await write_frame(conn.stream.writer, PushForward(forward=fwd, route=[PushHop(me, "s")]), data)
            replies.append(decode_reply((await read_frame(conn.stream.reader, CONFIG.frame_limits))[0]))
            await conn.close()
        await asyncio.sleep(1.0)  # a dial, had there been one, has long arrived
        listener.close()
        return replies, me

    (with_addresses, unannounced), me = asyncio.run(main())
    assert isinstance(with_addresses, ErrorReply) and with_addresses.code == "malformed"
    assert isinstance(unannounced, ErrorReply) and unannounced.code == "internal"
    assert unannounced.failed_peer == me and unannounced.message == UNREACHABLE
    assert seen == []


def test_a_verified_ring_shows_the_client_every_hop(cluster):
    """A verifying client runs its routes as rings too: every hop answers the client's wait
    with its own signed reply of each step, so each hop's exchange is taped and re-executed on
    a replica as for a driven step; honest peers pass every check."""
    path, peers = cluster
    model = LocalModelInfo.load(path)
    ids = _prompt(path, "Check every hop of the ring.")
    config = replace(CONFIG, verify_share=0.5, verify_hold=True, push=RING)
    entries = [(p.maddrs[0], *p.layers) for p in peers[:4]]

    async def main():
        async with AsyncClient(peers=entries, model=path, config=config, seed=5, model_info=model) as client:
            reply = await client.generate(ids, max_new_tokens=GREEDY.max_new_tokens, ignore_eos=True)
            return reply.tokens, client.verifier.stats

    tokens, stats = asyncio.run(main())
    assert tokens == reference_generate(path, ids, GREEDY.max_new_tokens)
    assert stats.sampled > 0 and stats.verified > 0 and stats.mismatches == 0, stats


def test_a_peer_killed_mid_generation_is_reported_and_routed_around(cluster):
    path, peers = cluster
    ids = _prompt(path, "Even when a peer dies on the way.")
    tokens, pipeline = asyncio.run(_generate(path, peers, ids, kill_after=5))
    assert tokens == reference_generate(path, ids, GREEDY.max_new_tokens)
    # B could not reach the dead last hop and said so: the client drove the route, could not reach
    # C either, banned C (not A or B) and re-routed
    assert [f.hop.peer_id for f in pipeline.failures] == [peers[2].peer_id]
    assert pipeline.route[-1].peer_id == peers[3].peer_id


def test_a_ring_batch_cannot_step_another_clients_session(cluster):
    """Ring steps travel between peers in batches (``PushBatch``, one frame for every session a
    peer sends on at once). A batch is taken item by item, each against its own session's grant:
    an attacker's batch naming a victim's session on B, whose grant names A, gets that item
    refused (``unknown_session``, as for an id never opened), and so does its own session's
    item, whose grant B refused: the grant named the attacker's node, of which B holds no
    record (a push source must be a peer announced in the swarm). Each item is answered on its
    own. A batch whose items do not add up to its payload is refused whole, typed; the stream
    goes on serving, and the victim's session is untouched."""
    path, peers = cluster
    model = LocalModelInfo.load(path)
    a, b = peers[:2]

    async def main():
        async with client_node(CONFIG) as victim_node, client_node(CONFIG) as mallory:
            victim = HopConnection(victim_node, b.hop(), CONFIG.frame_limits, 30.0)
            await victim.open(model.spec.model_id, None, 64, SamplingParams())
            await victim.call(AllowPush(session_id=victim.session_id, from_peer=a.peer_id))
            own = HopConnection(mallory, b.hop(), CONFIG.frame_limits, 30.0)
            await own.open(model.spec.model_id, None, 64, SamplingParams())
            try:
                refused = await own.call(AllowPush(session_id=own.session_id, from_peer=mallory.peer_id))
            except BadRequestError as e:
                refused = e
            hidden = torch.zeros(1, model.spec.hidden_size, dtype=torch.float32)
            meta, data = tensor_to_wire(hidden)
            items = [PushForward(forward=Forward(session_id=sid, step=1, position=0, tensor=meta), ring=True)
                     for sid in (victim.session_id, own.session_id)]
            link = HopConnection(mallory, b.hop(), CONFIG.frame_limits, 30.0)
            await link.connect()
            await write_frame(link.stream.writer, PushBatch(seq=0, items=items), bytes(data) * 2)
            stolen = decode_reply((await read_frame(link.stream.reader, CONFIG.frame_limits))[0])
            await write_frame(link.stream.writer, PushBatch(seq=1, items=items), bytes(data))  # one payload short
            short = decode_reply((await read_frame(link.stream.reader, CONFIG.frame_limits))[0])
            stats, _ = await link.call(GetStats())
            # the victim's session is where the victim left it: its own step 0 runs from position 0
            ids = torch.tensor(model.chat_ids([{"role": "user", "content": "still mine"}]), dtype=torch.int64)
            vmeta, vdata = tensor_to_wire(torch.randn(ids.shape[0], model.spec.hidden_size))
            result, _ = await victim.call(Forward(session_id=victim.session_id, step=0, position=0, tensor=vmeta), vdata)
            for conn in (victim, own, link):
                await conn.close()
            return refused, stolen, short, stats, result, ids.shape[0], (victim.session_id, own.session_id)

    refused, stolen, short, stats, result, n, sessions = asyncio.run(main())
    assert isinstance(refused, BadRequestError), refused  # B holds no record of the attacker's node
    assert isinstance(stolen, PushBatchAck) and stolen.seq == 0
    codes = {r.session_id: r.code for r in stolen.failed}
    assert codes == {sid: "unknown_session" for sid in sessions}, stolen  # each item on its own
    assert isinstance(short, ErrorReply) and short.code == "bad_request" and short.session_id is None
    assert short.step == 1  # a refused batch is named by its seq
    assert isinstance(stats, PeerStats)
    assert isinstance(result, ForwardResult) and result.position == n  # it ran from position 0
