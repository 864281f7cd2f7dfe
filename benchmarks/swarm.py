"""Swarm benchmark of the client: routing over several peers, time to first token, failover cost.

Every figure is measured in this one run, on loopback:

* aggregate decode tokens/s of 16 concurrent clients (each its own IWRR seed, each with its own
  failover Pipeline) across 4 peers — two replicas of each half of the model — against the same
  16 clients on one peer that holds the whole model;
* time to first token (median over those requests, prompt prefill included);
* the time a failover adds: one greedy request whose route loses a peer (SIGKILL) mid-way; the
  gap between the tokens around the failure minus the median gap between tokens, and whether
  the output still equals the run without a failure.

Usage: python benchmarks/swarm.py [--model default] [--tokens 32] [--clients 16] [--out FILE]
Each peer runs one torch thread (the CI machine has two shared cores; say so when quoting).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pserve.client.failover import FailoverState  # noqa: E402
from p2pserve.client.generation import Generation  # noqa: E402
from p2pserve.client.model_info import LocalModelInfo  # noqa: E402
from p2pserve.client.node import client_transport  # noqa: E402
from p2pserve.client.params import GenerationParams  # noqa: E402
from p2pserve.client.pipeline import Pipeline  # noqa: E402
from p2pserve.client.route_providers import PeerListRoutes  # noqa: E402
from p2pserve.config import ClientConfig  # noqa: E402
from p2pserve.launch import start_peers  # noqa: E402

PROMPTS = [f"Request {i}: explain in a few sentences why sharing GPUs between volunteers helps." for i in range(64)]


async def run_clients(model: LocalModelInfo, peers, n_clients: int, tokens: int, config: ClientConfig) -> dict:
    """16 clients at once, each with its own routing seed; returns throughput and TTFTs."""
    transport = await client_transport(config)
    spec = model.spec
    params = GenerationParams(max_new_tokens=tokens, ignore_eos=True)
    known = [p.hop() for p in peers]
    routes_used: dict[tuple, int] = {}

    async def one(i: int):
        ids = model.chat_ids([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
        routes = PeerListRoutes(spec.num_layers, known, seed=1000 + i)  # a distinct client
        pipeline = Pipeline(transport, routes, spec.model_id, spec.num_layers, len(ids) + tokens, params.validate(),
                            config, FailoverState(config))
        t0 = time.perf_counter()
        first = None
        gen = Generation(pipeline, ids, params, model.eos_ids)
        try:
            async for _ in gen:
                if first is None:
                    first = time.perf_counter() - t0
        finally:
            await pipeline.close()
        key = tuple(h.peer_id[-6:] + f"[{h.start}:{h.end})" for h in pipeline.route)
        routes_used[key] = routes_used.get(key, 0) + 1
        return first, len(gen.result.tokens), time.perf_counter() - t0

    try:
        # one warm-up request so that first-connection costs are not in the figures
        await one(0)
        routes_used.clear()
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(i) for i in range(n_clients)))
        wall = time.perf_counter() - t0
    finally:
        await transport.close()
    ttfts = [o[0] for o in outs]
    return {
        "clients": n_clients,
        "tokens_per_client": tokens,
        "aggregate_tokens_per_s": sum(o[1] for o in outs) / wall,
        "wall_s": wall,
        "ttft_median_s": statistics.median(ttfts),
        "ttft_max_s": max(ttfts),
        "routes": {" -> ".join(k): v for k, v in sorted(routes_used.items())},
    }


async def failover_run(model: LocalModelInfo, peers, tokens: int, kill_after: int | None, config: ClientConfig) -> dict:
    """One greedy request; optionally SIGKILL the last hop's peer after ``kill_after`` tokens."""
    transport = await client_transport(config)
    spec = model.spec
    by_id = {p.peer_id: p for p in peers}
    ids = model.chat_ids([{"role": "user", "content": PROMPTS[0]}])
    params = GenerationParams(max_new_tokens=tokens, ignore_eos=True)
    routes = PeerListRoutes(spec.num_layers, [p.hop() for p in peers], seed=7)
    pipeline = Pipeline(transport, routes, spec.model_id, spec.num_layers, len(ids) + tokens, params.validate(),
                        config, FailoverState(config))
    stamps = [time.perf_counter()]
    gen = Generation(pipeline, ids, params, model.eos_ids)
    result = gen.result
    try:
        async for _ in gen:
            stamps.append(time.perf_counter())
            if kill_after is not None and len(result.tokens) == kill_after:
                victim = by_id[pipeline.route[-1].peer_id]
                await asyncio.to_thread(victim.kill)
                stamps[-1] = time.perf_counter()  # do not count the kill itself
    finally:
        await pipeline.close()
        await transport.close()
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]
    out = {"tokens": result.tokens, "failures": [str(f) for f in pipeline.failures],
           "median_gap_s": statistics.median(gaps)}
    if kill_after is not None:
        gap = gaps[kill_after - 1]  # from token kill_after to the next one
        out["failover_gap_s"] = gap
        out["failover_added_s"] = gap - out["median_gap_s"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "swarm.json"))
    args = ap.parse_args()

    model = LocalModelInfo.load(None if args.model == "default" else args.model)
    path, L = model.path, model.spec.num_layers
    half = L // 2
    config = ClientConfig(hop_timeout_s=60.0, max_retries=3)
    report: dict = {"model": model.spec.model_id, "num_layers": L, "threads_per_peer": 1}

    print(f"model {model.spec.model_id} ({L} layers); {args.clients} clients x {args.tokens} tokens", flush=True)
    single = start_peers(path, [(0, L)])
    try:
        report["one_peer"] = asyncio.run(run_clients(model, single, args.clients, args.tokens, config))
    finally:
        for p in single:
            p.stop()
    print(f"one peer, whole model: {report['one_peer']['aggregate_tokens_per_s']:.1f} tokens/s", flush=True)

    four = start_peers(path, [(0, half), (0, half), (half, L), (half, L)])
    try:
        report["four_peers"] = asyncio.run(run_clients(model, four, args.clients, args.tokens, config))
        print(f"four peers (2 x 2 halves): {report['four_peers']['aggregate_tokens_per_s']:.1f} tokens/s", flush=True)
        clean = asyncio.run(failover_run(model, four, args.tokens, None, config))
        failed = asyncio.run(failover_run(model, four, args.tokens, args.tokens // 2, config))
        report["failover"] = {
            "median_gap_s": failed["median_gap_s"],
            "failover_gap_s": failed["failover_gap_s"],
            "failover_added_s": failed["failover_added_s"],
            "identical_output": failed["tokens"] == clean["tokens"],
            "failures": failed["failures"],
        }
    finally:
        for p in four:
            p.stop()

    one, many = report["one_peer"], report["four_peers"]
    report["ratios"] = {
        "aggregate_throughput_4_peers_vs_1": many["aggregate_tokens_per_s"] / one["aggregate_tokens_per_s"],
        "ttft_median_4_peers_vs_1": many["ttft_median_s"] / one["ttft_median_s"],
        "failover_added_vs_token_gap": report["failover"]["failover_added_s"] / report["failover"]["median_gap_s"],
    }
    print(json.dumps({k: v for k, v in report.items() if k != "failover"} | {"failover": {
        k: v for k, v in report["failover"].items() if k != "failures"}}, indent=2))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
