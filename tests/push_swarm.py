"""The push tests' in-memory swarm, shared by ``tests/unit/client/test_push.py`` and ``test_ring.py``.

Real peer handlers, each holding a span of a real tiny Llama (real shards and compute workers),
on an in-memory transport; each finds the next hop's addresses in its own view of an in-memory
swarm (``FakeSwarm``, with the real reader's identity rules). The fixtures ``model`` and
``swarm`` are imported by the test modules that use them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2pserve.client.connection import HopConnection
from p2pserve.client.failover import FailoverState
from p2pserve.client.hop import Hop
from p2pserve.client.pipeline import Pipeline
from p2pserve.config import ClientConfig, PeerConfig, PushConfig
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.records import PeerInfo
from p2pserve.model.shard import Shard
from p2pserve.peer.next_hop import AnnouncedAddresses
from p2pserve.peer.runtime import build_runtime
from p2pserve.peer.sessions import SessionTable
from p2pserve.protocol import SESSION_PROTOCOL, FrameLimits, SamplingParams, decode_reply
from p2pserve.testing.swarm import FakeSwarm, FakeSwarmStore
from p2pserve.transport.frames import read_frame, write_frame
from p2pserve.transport.memory import MemoryNetwork
from tests.harness import tiny_session_table

# base58 peer ids (no 0, O, I, l), as libp2p's
A, B, C, C2 = "QmPeerA", "QmPeerB", "QmPeerC", "QmPeerD"
CONFIG = ClientConfig(max_retries=3, stale_route_pause_s=0.0, hop_timeout_s=20.0, verify_share=0.0)

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A 3-layer tiny Llama: its path and spec."""
    path, spec, _, _ = tiny_session_table(tmp_path_factory.mktemp("tiny"), num_layers=3)
    return path, spec


#: Every peer of the push swarm: a KV budget far above what the tests use, short idle and request timeouts.
PEER = PeerConfig(kv_budget_token_layers=1_000_000, session_idle_timeout_s=60.0, request_timeout_s=20)
SPANS = {A: (0, 1), B: (1, 2), C: (2, 3), C2: (2, 3)}


class Swarm:
    """Real handlers on an in-memory network: ``spans`` maps peer id -> (start, end); each peer is
    built from ``configs[peer id]`` (default ``PEER``) by the peer's own ``build_runtime``.
    ``announced`` False: no peer's record is in the swarm (peers named by a fixed list, each in
    a DHT of its own), so no peer can find another."""

    def __init__(self, model, spans: dict[str, tuple[int, int]], configs: dict[str, PeerConfig] | None = None,
                 announced: bool = True):
        path, spec = model
        self.spec, self.net, self.workers, self.handlers = spec, MemoryNetwork(), [], {}
        self.records = FakeSwarmStore()  # each peer's PeerInfo, signed by its own (fake) key
        for pid in spans if announced else ():
            self.records.put(RecordKind.PEERS, f"key-{pid}", PeerInfo(model="tiny", peer_id=pid, addrs=[f"/memory/p2p/{pid}"]))
        for pid, (start, end) in spans.items():
            rt = build_runtime((configs or {}).get(pid, PEER), spec, pid, self.net.transport(pid),
                               shard=Shard.load(path, spec, start, end), served=(start, end),
                               resolve=AnnouncedAddresses(FakeSwarm(self.records, name=pid)))
            rt.worker.start()
            self.net.serve(pid, SESSION_PROTOCOL, rt.handler.handle_stream)
            self.workers.append(rt.worker)
            self.handlers[pid] = rt.handler
        self.hops = {pid: Hop(pid, *span, (f"/memory/p2p/{pid}",)) for pid, span in spans.items()}

    def stop(self):
        for w in self.workers:
            w.stop()


def tiny_session_table_for(model, start, end):
    from p2pserve.peer.kv_cache import KVBudget

    path, spec = model
    budget = KVBudget(1_000_000)
    table = SessionTable(spec=spec, served=(start, end), budget=budget, idle_timeout_s=60.0, torch_dtype=torch.float32)
    return path, spec, budget, table


@pytest.fixture
def swarm(model):
    s = Swarm(model, SPANS)
    yield s
    s.stop()


async def _generate(swarm, routes, push: PushConfig, prompt, n, kill_after=None, sampling=SamplingParams(),
                    extras: bool = False, replies: list | None = None, config: ClientConfig = CONFIG):
    """``n`` greedy tokens after ``prompt`` and the (closed) pipeline; ``extras``: the pipeline's
    (driven steps carry their token ids); ``replies`` gets each step's last-hop reply."""
    config = dataclasses.replace(config, push=push)
    pipeline = Pipeline(swarm.net.transport("QmClient"), routes, swarm.spec.model_id, 3, 64, sampling,
                        config, FailoverState(config), vocab_size=swarm.spec.vocab_size, extras=extras)
    out, pending = [], list(prompt)
    try:
        for i in range(n):
            tok = await pipeline.step(pending)
            out.append(tok)
            if replies is not None:
                replies.append(pipeline.last_reply)
            pending = [tok]
            if kill_after is not None and i + 1 == kill_after[0]:
                if callable(kill_after[1]):
                    kill_after[1]()
                else:
                    swarm.net.disconnect(kill_after[1])
        return out, pipeline
    finally:
        await pipeline.close()


async def _raw(transport, peer, msg, payload=b""):
    """One frame on a fresh stream from ``transport`` to ``peer``; the decoded reply."""
    stream = await transport.open_stream(peer, [], SESSION_PROTOCOL, 5)
    await write_frame(stream.writer, msg, payload)
    header, _ = await read_frame(stream.reader, FrameLimits())
    stream.close()
    return decode_reply(header)


async def _open(swarm, client, pid, sid):
    conn = HopConnection(swarm.net.transport(client), swarm.hops[pid], FrameLimits(), 10)
    await conn.open(swarm.spec.model_id, sid, 16, SamplingParams())
    return conn
