"""What the Prometheus instrumentation costs on the decode path (``docs/metrics.md``).

Two real code paths, each timed with its metrics object and without it (the baseline), in
alternating rounds of the same run:

* client: ``Pipeline.step`` decode steps through two hops (real pipeline, connections and frame
  codec over the in-memory transport to fake peers): with ``ClientMetrics`` one histogram
  observation per hop, against none;
* peer: one-token decode steps of a real ``ComputeWorker`` (``run_inline``, the lone-session
  path) over a 2-layer tiny Llama: with ``PeerMetrics`` one counter increment and three
  histogram observations per step, against none.

Prints the median time per step both ways and their ratio, and writes JSON.

    python benchmarks/metrics.py [--steps 200] [--rounds 9] [--json benchmarks/results/metrics.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path


async def _client_round(net, hops, metrics, steps: int) -> float:
    """Median seconds of one decode step through ``hops``."""
    from p2pserve.client.pipeline import Pipeline
    from p2pserve.testing import FixedRoutes

    pipeline = Pipeline(net.client(), FixedRoutes(hops), "fake-model", 8, max_length=steps + 8, metrics=metrics)
    try:
        token = await pipeline.step([1, 2, 3])
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            token = await pipeline.step([token])
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        await pipeline.close()


async def client_overhead(steps: int, rounds: int) -> dict:
    from p2pserve.metrics import ClientMetrics
    from p2pserve.testing import FakePeerNetwork

    net = FakePeerNetwork(num_layers=8)
    hops = [net.add("a", 0, 4), net.add("b", 4, 8)]
    metrics = ClientMetrics()
    base, inst = [], []
    for _ in range(rounds):
        base.append(await _client_round(net, hops, None, steps))
        inst.append(await _client_round(net, hops, metrics, steps))
    return _summary(base, inst)


async def _peer_round(worker, table, steps: int, name: str) -> float:
    import torch

    from p2pserve.peer.worker import Job
    from p2pserve.protocol import PROTOCOL_VERSION, OpenSession, SamplingParams

    spec = table.spec
    session = table.open(OpenSession(version=PROTOCOL_VERSION, model_id=spec.model_id, session_id=name, start=0,
                                     end=spec.num_layers, max_length=steps + 1, sampling=SamplingParams()), owner=None)
    loop = asyncio.get_running_loop()
    times = []
    for pos in range(steps):
        job = Job(session, torch.tensor([pos % 100 + 1]), pos, True, loop.create_future(), loop)
        t0 = time.perf_counter()
        assert worker.run_inline(job)
        times.append(time.perf_counter() - t0)
    table.close(name, None)
    return statistics.median(times)


async def peer_overhead(steps: int, rounds: int) -> dict:
    import torch

    from p2pserve.metrics import PeerMetrics
    from p2pserve.model.shard import Shard
    from p2pserve.model.spec import load_spec
    from p2pserve.model.tiny import build_tiny_model
    from p2pserve.peer.batcher import TokenThrottle
    from p2pserve.peer.kv_cache import KVBudget
    from p2pserve.peer.sessions import SessionTable
    from p2pserve.peer.worker import ComputeWorker

    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_model("llama", Path(tmp) / "tiny", num_layers=2))
        spec = load_spec(path)
        budget = KVBudget(1_000_000)
        table = SessionTable(spec=spec, served=(0, 2), budget=budget, idle_timeout_s=600.0, torch_dtype=torch.float32)
        shard = Shard.load(path, spec, 0, 2)
        # two workers over one shard and budget, alike but for the metrics they are built with
        plain = ComputeWorker(shard, TokenThrottle(), budget)
        counted = ComputeWorker(shard, TokenThrottle(), budget, metrics=PeerMetrics(dict))
        base, inst = [], []
        for r in range(rounds):
            base.append(await _peer_round(plain, table, steps, f"base{r}"))
            inst.append(await _peer_round(counted, table, steps, f"inst{r}"))
    return _summary(base, inst)


def _summary(base: list[float], inst: list[float]) -> dict:
    b, i = statistics.median(base), statistics.median(inst)
    return {"baseline_us": round(b * 1e6, 2), "instrumented_us": round(i * 1e6, 2), "ratio": round(i / b, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=9, help="rounds each way, alternating")
    parser.add_argument("--json", default="benchmarks/results/metrics.json", help="where to write the results")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    result = {
        "client_decode_step_2_hops": asyncio.run(client_overhead(args.steps, args.rounds)),
        "peer_decode_step_tiny_2_layers": asyncio.run(peer_overhead(args.steps, args.rounds)),
        "steps": args.steps,
        "rounds": args.rounds,
    }
    for name in ("client_decode_step_2_hops", "peer_decode_step_tiny_2_layers"):
        r = result[name]
        print(f"{name}: {r['baseline_us']:.1f} us without metrics, {r['instrumented_us']:.1f} us with: "
              f"{r['ratio']:.3f}x")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
