"""The peer's inline decode (``ComputeWorker.run_inline``), driven directly: no timing involved."""

from __future__ import annotations

import asyncio

import torch

from p2pserve.config import BatchingConfig
from p2pserve.model.shard import Shard
from p2pserve.peer.batcher import TokenThrottle
from p2pserve.peer.worker import ComputeWorker, Job
from tests.harness import open_session, tiny_session_table

PROMPT = [5, 17, 42, 7]


def test_a_lone_decode_runs_inline_and_matches_the_worker_thread(tmp_path):
    path, spec, budget, table = tiny_session_table(tmp_path / "tiny")
    shard = Shard.load(path, spec, 0, spec.num_layers)
    worker = ComputeWorker(shard, TokenThrottle(BatchingConfig()), budget)
    worker.start()
    idle = ComputeWorker(shard, TokenThrottle(BatchingConfig()), budget)  # never started: jobs stay queued

    def open_(name):
        return open_session(table, name)

    async def run(inline: bool) -> list[int]:
        loop = asyncio.get_running_loop()
        session = open_(f"inline={inline}")

        def job(ids, position):
            return Job(session=session, inputs=torch.tensor(ids), position=position, sample=True,
                       future=loop.create_future(), loop=loop)

        prefill = job(PROMPT, 0)
        worker.submit(prefill)
        tokens = [await prefill.future]
        for step in range(3):
            decode = job([tokens[-1]], len(PROMPT) + step)
            if inline:
                assert worker.run_inline(decode)  # an idle worker: this thread runs the step
                assert decode.future.done()
            else:
                worker.submit(decode)
            tokens.append(await decode.future)
        # A worker with a job queued declines, and the caller submits instead.
        queued = job([tokens[-1]], len(PROMPT) + 3)
        idle.submit(job([tokens[-1]], len(PROMPT) + 3))
        assert not idle.run_inline(queued) and not queued.future.done()
        return tokens

    threads = torch.get_num_threads()
    try:
        on_thread = asyncio.run(run(inline=False))
        before = worker.stats.inline_steps
        torch.set_num_threads(1)  # inline steps are for one-threaded CPU peers (and GPUs)
        inline = asyncio.run(run(inline=True))
    finally:
        torch.set_num_threads(threads)
        worker.stop()
    assert inline == on_thread
    assert before == 0 and worker.stats.inline_steps == 3


def test_a_multi_threaded_cpu_peer_runs_its_steps_on_the_compute_thread(tmp_path):
    # The I/O thread does not get the torch thread count's speed-up (peer/worker.py docstring).
    path, spec, budget, table = tiny_session_table(tmp_path / "tiny")
    worker = ComputeWorker(Shard.load(path, spec, 0, spec.num_layers), TokenThrottle(BatchingConfig()), budget)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        async def run() -> bool:
            loop = asyncio.get_running_loop()
            job = Job(session=open_session(table, "s"), inputs=torch.tensor(PROMPT), position=0, sample=True,
                      future=loop.create_future(), loop=loop)
            return worker.run_inline(job)

        assert not asyncio.run(run())
    finally:
        torch.set_num_threads(threads)
