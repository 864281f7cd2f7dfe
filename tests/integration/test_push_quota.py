"""One client cannot fill the push link between two honest peers: real peer processes.

Two `p2pserve peer` processes on the tiny Llama, A on layers [0, 4) and B on [4, 8), each behind
a delay relay adding 20 ms each way (``p2pserve/testing/wan.py``: a dial takes as long as on a
real link), meet at a bootstrap node; A finds where B is in B's own record. Each lets one remote
peer id keep ``CAP`` streams open (``--max-streams-per-owner``, 256 by default: small here so
the attacks stay short).

* The attacker opens more sessions than that on A and on B (each peer's on one stream), lets A
  push into its sessions on B and pushes each A session once: A opens a stream to B per
  session. Those streams used to count against A's allowance at B: once A held ``CAP`` of them
  for the attacker, B refused A's next stream, and an honest client's push through A failed with
  B blamed. B now counts a forwarded stream against the client whose session it pushes into.
* While it dials, a stream is still A's own at B (B learns whose it is from its first frame).
  An attacker pushing from several streams at once kept A at its bound at B for moments on end,
  and a quarter of an honest client's new links were refused (B blamed). A now keeps few dials
  to one next hop under way at once and tries again a dial refused for its own stream count
  (``peer/link_dialer.py``).

Either way the attacker's own pushes past its bound get a typed ``overloaded`` error, and the
honest client's pushes through A and B go through, its generation equal to ``generate``.
"""

from __future__ import annotations

import asyncio
import secrets

import pytest
import torch

from p2pserve.client.connection import HopConnection
from p2pserve.client.generation import generate
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.client.params import GenerationParams
from p2pserve.config import ClientConfig, PushConfig
from p2pserve.protocol import (
    PROTOCOL_VERSION,
    AllowPush,
    ErrorReply,
    Forward,
    OpenSession,
    PushAck,
    PushForward,
    PushHop,
    SamplingParams,
)
from p2pserve.testing.wan import announced_swarm
from p2pserve.transport.frames import tensor_to_wire
from tests.harness import client_node, open_chain_pipeline, reference_generate

pytestmark = pytest.mark.integration

CAP = 4  # streams one remote peer id may keep open at each peer
ATTACK_SESSIONS = 2 * CAP + 2  # more pushed sessions than B lets any one peer id hold streams
CONFIG = ClientConfig(hop_timeout_s=60.0, max_retries=2, verify_share=0.0, push=PushConfig(enabled=True, min_rtt_ms=0))
GREEDY = GenerationParams(max_new_tokens=6, ignore_eos=True)
HONEST_LINKS = 10  # new links from A to B under the burst (before: several refused in every run)


@pytest.fixture(scope="module")
def pair(model_dir, tmp_path_factory):
    path = model_dir("llama")
    tmp = tmp_path_factory.mktemp("push-quota")
    with announced_swarm(path, [(0, 4), (4, 8)], "--max-streams-per-owner", str(CAP), delay_ms=20.0, workdir=tmp,
                         num_layers=8, stop_timeout=2.0) as (_, relayed):  # no need to withdraw records gracefully
        yield path, [rp.peer for rp in relayed]


async def _sessions(transport, hop, model_id: str, n: int) -> tuple[HopConnection, list[str]]:
    """``n`` sessions on ``hop``'s peer, all on one stream (a peer binds sessions to a stream,
    not one per stream): the opener's own streams stay far below its bound."""
    conn = HopConnection(transport, hop, CONFIG.frame_limits, 60.0)
    await conn.connect()
    ids = []
    for _ in range(n):
        sid = secrets.token_hex(8)
        await conn.call(OpenSession(version=PROTOCOL_VERSION, model_id=model_id, session_id=sid, start=hop.start,
                                    end=hop.end, max_length=16, sampling=SamplingParams()))
        ids.append(sid)
    return conn, ids


async def _routes(transport, a, b, model_id: str, n: int):
    """``n`` sessions on A and ``n`` on B that A may push into: (A's stream, B's stream, id pairs)."""
    on_a, a_ids = await _sessions(transport, a.hop(), model_id, n)
    on_b, b_ids = await _sessions(transport, b.hop(), model_id, n)
    for sid in b_ids:
        await on_b.call(AllowPush(session_id=sid, from_peer=a.peer_id))
    return on_a, on_b, list(zip(a_ids, b_ids))


async def _push(on_a: HopConnection, b, a_sid: str, b_sid: str):
    """One step pushed A -> B into a session pair; the reply as it came (``call`` raises an ErrorReply)."""
    meta, data = tensor_to_wire(torch.tensor([1, 2, 3], dtype=torch.int64))
    fwd = Forward(session_id=a_sid, step=0, position=0, tensor=meta)
    await on_a.send(PushForward(forward=fwd, route=[PushHop(b.peer_id, b_sid)]), data)
    return (await on_a.read())[0]


def _own_fault(reply) -> bool:
    """A reply the attacker may get: an ack, or the typed refusal of its own excess at B."""
    return isinstance(reply, PushAck) or (isinstance(reply, ErrorReply) and reply.code == "overloaded")


def test_one_client_cannot_fill_the_push_link_between_two_honest_peers(pair):
    path, (a, b) = pair
    model = LocalModelInfo.load(path)
    model_id = model.spec.model_id
    ids = model.chat_ids([{"role": "user", "content": "Push it through, whoever else is pushing."}])

    async def main():
        async with client_node(CONFIG) as mallory:
            on_a, on_b, pairs = await _routes(mallory, a, b, model_id, ATTACK_SESSIONS)
            attack = [await _push(on_a, b, *p) for p in pairs]  # one push per session: a stream A -> B each
            # the honest client's turn, while the attacker holds every session and stream it opened
            async with client_node(CONFIG) as honest:
                pipeline = await open_chain_pipeline(honest, [a.hop(), b.hop()], model, 64, GREEDY, CONFIG)
                try:
                    tokens = (await generate(pipeline, ids, GREEDY, model.eos_ids)).tokens
                except Exception as e:  # no route left: the failures say which hop was blamed
                    tokens = repr(e)
                finally:
                    await pipeline.close()
            await on_a.close()
            await on_b.close()
            return attack, tokens, pipeline

    attack, tokens, pipeline = asyncio.run(main())
    refused = [r for r in attack if isinstance(r, ErrorReply)]
    # the attacker's pushes past its own bound at B (its stream there and the forwarded ones) fail, typed
    assert all(_own_fault(r) for r in attack) and all(r.failed_peer == b.peer_id for r in refused), attack
    assert len(refused) >= ATTACK_SESSIONS - CAP + 1, attack
    assert [f.hop.peer_id for f in pipeline.failures] == [], pipeline.failures  # B not blamed, nor A
    assert tokens == reference_generate(path, ids, GREEDY.max_new_tokens)
    assert pipeline.forwarding.pushed_steps == GREEDY.max_new_tokens  # every step went A -> B


def test_a_burst_of_pushes_through_a_peer_leaves_room_for_honest_links(pair):
    """The attacker, as two client identities, pushes from ``CAP - 1`` streams on A each, all at
    once and over and over (most refused at B, each refusal a new dial from A); meanwhile an
    honest client opens a new session pair at a time and pushes it once through A: every push is
    acked. (The attacker's replies are acks and typed errors.)"""
    path, (a, b) = pair
    model_id = LocalModelInfo.load(path).spec.model_id
    stop, attack = asyncio.Event(), []

    async def attacker(transport):
        """One identity's burst until ``stop``: its sessions on B on one stream, ``CAP - 1`` streams on A."""
        on_b, b_ids = await _sessions(transport, b.hop(), model_id, CAP * (CAP - 1))
        for sid in b_ids:
            await on_b.call(AllowPush(session_id=sid, from_peer=a.peer_id))
        streams = [await _sessions(transport, a.hop(), model_id, CAP) for _ in range(CAP - 1)]

        async def burst(on_a, pairs):
            while not stop.is_set():
                for a_sid, b_sid in pairs:
                    attack.append(await _push(on_a, b, a_sid, b_sid))

        await asyncio.gather(*(burst(on_a, list(zip(a_ids, b_ids[i * CAP:]))) for i, (on_a, a_ids) in enumerate(streams)))
        for on_a, _ in streams:
            await on_a.close()
        await on_b.close()

    async def main():
        async with client_node(CONFIG) as m1, client_node(CONFIG) as m2, client_node(CONFIG) as honest:
            tasks = [asyncio.create_task(attacker(m)) for m in (m1, m2)]
            replies = []
            try:
                while len(attack) < 2 * CAP and not any(t.done() for t in tasks):  # the burst is on
                    await asyncio.sleep(0.1)
                # each round its own stream at B, the new forwarded one and the last round's (until A
                # drops it): within its bound
                for _ in range(HONEST_LINKS):
                    on_a, h_b, pairs = await _routes(honest, a, b, model_id, 1)
                    replies += [await _push(on_a, b, *p) for p in pairs]
                    await on_a.close()
                    await h_b.close()
            finally:
                stop.set()
                ended = await asyncio.gather(*tasks, return_exceptions=True)
            return replies, ended

    replies, ended = asyncio.run(main())
    assert ended == [None, None], ended  # the burst ran to the end
    assert len(attack) > HONEST_LINKS and all(isinstance(r, (PushAck, ErrorReply)) for r in attack), attack[:8]
    assert all(isinstance(r, PushAck) for r in replies), [r for r in replies if not isinstance(r, PushAck)]
