"""A Forward that times out keeps its session busy until the worker is done with the job.

After a request timeout the handler cleared ``busy`` while the job was still
queued, so a retry could put two jobs on one cache, and a Close could release a KV reservation
the worker was still writing into. Here a real peer handler and a real tiny shard run over an
in-memory transport; the compute thread starts only after the timeout, so the job is still
queued when the client retries and closes.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from p2pserve.client.connection import HopConnection
from p2pserve.client.hop import Hop
from p2pserve.config import BatchingConfig
from p2pserve.errors import BadRequestError, OverloadedError
from p2pserve.model.shard import Shard
from p2pserve.peer.batcher import TokenThrottle
from p2pserve.peer.handlers import SessionHandler
from p2pserve.peer.worker import ComputeWorker
from p2pserve.protocol import SESSION_PROTOCOL, FrameLimits, SamplingParams
from p2pserve.transport.memory import MemoryNetwork
from tests.harness import tiny_session_table


@pytest.fixture
def peer(tmp_path):
    path, spec, budget, table = tiny_session_table(tmp_path / "m")
    shard = Shard.load(path, spec, 0, spec.num_layers)
    # No inline decode: every job goes through the (not yet started) thread.
    worker = ComputeWorker(shard, TokenThrottle(BatchingConfig(inline_lone_decode_s=0)), budget)
    handler = SessionHandler(spec, table, worker, FrameLimits(), request_timeout_s=0.2)
    yield spec, table, budget, worker, handler
    worker.stop()


def test_a_timed_out_request_keeps_its_session_busy_and_close_waits_for_the_worker(peer):
    spec, table, budget, worker, handler = peer

    async def main():
        net = MemoryNetwork()
        net.serve("peer", SESSION_PROTOCOL, handler.handle_stream)
        conn = HopConnection(net.transport("client"), Hop("peer", 0, spec.num_layers, ("/memory",)), FrameLimits(), 5)
        await conn.open(spec.model_id, "s", 16, SamplingParams())
        reserved = budget.capacity - budget.free
        with pytest.raises(OverloadedError, match="waited"):
            await conn.forward(0, 0, torch.tensor([1, 2, 3]))
        # The job is still queued: a retry must not put a second job on the same cache.
        with pytest.raises(BadRequestError, match="in flight"):
            await conn.forward(0, 0, torch.tensor([1, 2, 3]))
        await conn.close()
        assert len(table) == 0
        assert budget.capacity - budget.free == reserved  # the worker may still write: not yet released
        worker.start()  # the worker drops the abandoned job of the closed session and settles it
        for _ in range(500):
            if budget.free == budget.capacity:
                break
            await asyncio.sleep(0.01)
        return worker.stats.steps

    steps = asyncio.run(main())
    assert budget.free == budget.capacity
    assert steps == 0  # nothing ran for nobody


def test_an_abandoned_job_is_skipped_and_the_session_serves_on(peer):
    spec, table, budget, worker, handler = peer

    async def main():
        net = MemoryNetwork()
        net.serve("peer", SESSION_PROTOCOL, handler.handle_stream)
        conn = HopConnection(net.transport("client"), Hop("peer", 0, spec.num_layers, ("/memory",)), FrameLimits(), 5)
        await conn.open(spec.model_id, "s", 16, SamplingParams())
        with pytest.raises(OverloadedError):
            await conn.forward(0, 0, torch.tensor([1, 2, 3]))
        worker.start()
        handler.request_timeout_s = 10
        for _ in range(500):
            try:
                reply, _ = await conn.forward(0, 0, torch.tensor([1, 2, 3]))
                return reply
            except BadRequestError:  # still settling the abandoned job
                await asyncio.sleep(0.01)

    reply = asyncio.run(main())
    assert reply.token is not None and reply.position == 3
    assert worker.stats.tokens == 3  # the abandoned prefill never ran; the retry did


def test_hidden_states_that_are_not_finite_are_refused_where_they_arrive(peer):
    """NaN hidden states sent to a mid-chain span were computed on and passed down the chain;
    the peer now refuses them at once, and the session serves on."""
    spec, table, budget, worker, handler = peer
    worker.start()

    async def main():
        net = MemoryNetwork()
        net.serve("peer", SESSION_PROTOCOL, handler.handle_stream)
        conn = HopConnection(net.transport("client"), Hop("peer", 1, spec.num_layers, ("/memory",)), FrameLimits(), 5)
        await conn.open(spec.model_id, "mid", 16, SamplingParams())
        with pytest.raises(BadRequestError, match="finite"):
            await conn.forward(0, 0, torch.full((3, spec.hidden_size), float("nan")))
        reply, _ = await conn.forward(0, 0, torch.zeros(3, spec.hidden_size))
        return reply

    assert asyncio.run(main()).token is not None
