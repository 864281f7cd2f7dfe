"""One bad job never kills the compute thread nor fails an honest job batched with it.

Reproduces a hostile-input finding against a real tiny Llama shard: a session whose sampling
temperature passes validation but overflows the logits (1e-45), and hidden states holding NaN sent
to a last-layer span, each used to kill ``ComputeWorker``'s thread for good.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from p2pserve.config import BatchingConfig
from p2pserve.errors import BadRequestError, RequestError
from p2pserve.model.shard import Shard
from p2pserve.peer.batcher import TokenThrottle
from p2pserve.peer.worker import ComputeWorker, Job
from p2pserve.protocol import SamplingParams
from tests.harness import open_session, tiny_session_table

PROMPT = [5, 17, 42, 7]


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    path, spec, budget, table = tiny_session_table(tmp_path_factory.mktemp("tiny") / "m")
    shard = Shard.load(path, spec, 0, spec.num_layers)
    worker = ComputeWorker(shard, TokenThrottle(BatchingConfig()), budget)
    worker.start()
    yield spec, table, worker
    worker.stop()


def _open(spec, table, name, start=0, sampling=SamplingParams()):
    return open_session(table, name, start=start, sampling=sampling)


def _job(session, inputs, position=0):
    loop = asyncio.get_running_loop()
    return Job(session=session, inputs=inputs, position=position, sample=True, future=loop.create_future(),
               loop=loop)


async def _settle(*jobs):
    return await asyncio.wait_for(asyncio.gather(*(j.future for j in jobs), return_exceptions=True), 10)


def test_an_overflowing_temperature_fails_its_job_only(peer):
    spec, table, worker = peer

    async def main():
        bad = _job(_open(spec, table, "tiny-temperature", sampling=SamplingParams(temperature=1e-45, seed=1)),
                   torch.tensor(PROMPT))
        honest = _job(_open(spec, table, "honest-1", sampling=SamplingParams(temperature=0.7, seed=1)),
                      torch.tensor(PROMPT))
        worker.submit(bad)
        worker.submit(honest)
        return await _settle(bad, honest)

    bad, honest = asyncio.run(main())
    assert isinstance(bad, BadRequestError) and "finite" in str(bad)
    assert isinstance(honest, int) and 0 <= honest < spec.vocab_size
    assert worker._thread.is_alive()


def test_nan_hidden_states_fail_their_job_only_and_the_thread_serves_on(peer):
    spec, table, worker = peer

    async def main():
        nan = torch.full((len(PROMPT), spec.hidden_size), float("nan"))
        bad = _job(_open(spec, table, "nan", start=1, sampling=SamplingParams(temperature=0.7, seed=3)), nan)
        honest = _job(_open(spec, table, "honest-2"), torch.tensor(PROMPT))
        worker.submit(bad)
        worker.submit(honest)
        first = await _settle(bad, honest)
        later = _job(_open(spec, table, "honest-3"), torch.tensor(PROMPT))
        worker.submit(later)
        return first, await _settle(later)

    (bad, honest), (later,) = asyncio.run(main())
    assert isinstance(bad, BadRequestError)
    assert isinstance(honest, int) and honest == later  # greedy, same prompt: the same token
    assert worker._thread.is_alive()


def test_a_job_whose_forward_raises_is_isolated_from_its_batch(peer):
    spec, table, worker = peer

    async def main():
        ok = _open(spec, table, "iso-ok")
        broken = _open(spec, table, "iso-broken")
        # Token ids out of the vocabulary make the embedding lookup raise inside forward_batch.
        bad = _job(broken, torch.tensor([spec.vocab_size + 5, 1, 2]))
        honest = _job(ok, torch.tensor(PROMPT))
        worker.submit(bad)
        worker.submit(honest)
        return await _settle(bad, honest)

    bad, honest = asyncio.run(main())
    assert isinstance(bad, Exception)
    assert isinstance(honest, int)
    assert worker._thread.is_alive()


def test_sessions_waiting_together_run_in_one_step_with_their_solo_tokens(peer):
    """Batching, without timing: eight prefills queued before the thread starts share one step,
    and each gets the token it gets alone."""
    spec, table, worker = peer
    batched = ComputeWorker(worker.shard, TokenThrottle(BatchingConfig()), worker.budget)
    prompts = [[5 + i, 17, 42, 7] for i in range(8)]

    async def main():
        alone = []
        for i, p in enumerate(prompts):
            job = _job(_open(spec, table, f"solo-{i}"), torch.tensor(p))
            worker.submit(job)
            alone.append(await asyncio.wait_for(job.future, 10))
        jobs = [_job(_open(spec, table, f"batched-{i}"), torch.tensor(p)) for i, p in enumerate(prompts)]
        for job in jobs:
            batched.submit(job)
        batched.start()
        together = await _settle(*jobs)
        return alone, together

    try:
        alone, together = asyncio.run(main())
    finally:
        batched.stop()
    assert together == alone
    assert batched.stats.max_batch_sessions == 8 and batched.stats.steps == 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_watchdog_restarts_a_compute_thread_that_ended(tmp_path):
    """Something the step's ``except Exception`` cannot catch ends the thread: ``revive`` starts a
    new one, fails the job that waited on the dead one (retriable) and serves the next."""
    path, spec, budget, table = tiny_session_table(tmp_path / "m")
    shard = Shard.load(path, spec, 0, spec.num_layers)
    throttle = TokenThrottle(BatchingConfig())
    worker = ComputeWorker(shard, throttle, budget)
    worker.start()
    schedule = throttle.schedule

    def ends_the_thread(*args):
        throttle.schedule = schedule  # only once
        raise SystemExit("a library called sys.exit() on the compute thread")

    throttle.schedule = ends_the_thread

    async def main():
        doomed = _job(_open(spec, table, "doomed"), torch.tensor(PROMPT))
        worker.submit(doomed)
        for _ in range(200):
            if not worker.alive:
                break
            await asyncio.sleep(0.01)
        assert not worker.alive
        assert worker.revive() and worker.alive and worker.restarts == 1
        assert not worker.revive()  # alive: nothing to do
        later = _job(_open(spec, table, "after-restart"), torch.tensor(PROMPT))
        worker.submit(later)
        return await _settle(doomed), await _settle(later)

    try:
        (doomed,), (later,) = asyncio.run(main())
    finally:
        worker.stop()
    assert isinstance(doomed, RequestError) and "restarted" in str(doomed)
    assert isinstance(later, int)


def test_a_step_that_hangs_is_reported_as_stuck(tmp_path):
    """A step that never returns (a hung kernel) cannot be killed, but the worker reports how long
    it has run; the peer announces itself draining past ``stuck_step_s`` (peer/server.py)."""
    path, spec, budget, table = tiny_session_table(tmp_path / "m")
    shard = Shard.load(path, spec, 0, spec.num_layers)
    release = threading.Event()
    forward = shard.forward_batch

    def hangs(segments):
        release.wait(10)
        return forward(segments)

    shard.forward_batch = hangs
    worker = ComputeWorker(shard, TokenThrottle(BatchingConfig()), budget)
    worker.start()

    async def main():
        job = _job(_open(spec, table, "hung"), torch.tensor(PROMPT))
        worker.submit(job)
        await asyncio.sleep(0.3)
        stuck = worker.stuck_for()
        release.set()
        await _settle(job)
        return stuck, worker.stuck_for()

    try:
        stuck, after = asyncio.run(main())
    finally:
        worker.stop()
    assert stuck >= 0.2 and after == 0.0
