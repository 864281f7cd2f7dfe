"""The ``throttle`` section of benchmarks/runtime.py: gLLM token throttling with chunked prefill,
on against off, on a real 3-peer SmolLM2 pipeline under a mixed load.

Sessions arrive over time (exponential gaps, seeded) with (prompt, reply) lengths drawn from the
Azure conversation trace, scaled down so that a run fits a 2-core machine (prompt ÷ 4, at most
``--throttle-max-prompt``; reply ÷ 16, 4 to ``--throttle-max-reply`` tokens); prompts are
random token ids. The same arrivals run twice on fresh peers, ``--prefill-throttle on`` (each
step's prefill budget chunks waiting prompts, decode first) and ``off`` (every waiting prompt whole
in the next step), alternating ``--throttle-rounds`` times. Per mode: aggregate tokens/s (all
generated tokens over the wall time from the first arrival to the last reply) and p95 of the
time between tokens of running sessions (every decode step's time, seen by the client).

* ``throttle_p95_tbt_gain``: p95 time between tokens, off over on (>1: throttling lowers it)
* ``throttle_throughput_ratio``: aggregate tokens/s, on over off
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time


def mixed_load(pairs, n: int, gap_s: float, max_prompt: int, max_reply: int, vocab: int, seed: int = 1):
    """``n`` sessions: (arrival s, prompt token ids, reply tokens), from trace ``pairs``."""
    rng = random.Random(seed)
    at, load = 0.0, []
    for prompt, reply in rng.sample(pairs, n):
        p = max(16, min(prompt // 4, max_prompt))
        r = max(4, min(reply // 16, max_reply))
        load.append((at, [rng.randrange(vocab) for _ in range(p)], r))
        at += rng.expovariate(1 / gap_s)
    return load


async def run_load(p2p, hops, model, load, open_session, generate, GenerationParams) -> dict:
    """Run every session of ``load`` at its arrival time; tokens/s and the decode step times."""
    gaps: list[float] = []
    tokens = 0

    async def one(at, ids, reply):
        nonlocal tokens
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        params = GenerationParams(max_new_tokens=reply, ignore_eos=True)
        session = await open_session(p2p, hops, model, len(ids) + reply + 8, params)
        steps = []
        original = session.step

        async def timed(x):
            t = time.perf_counter()
            r = await original(x)
            steps.append(time.perf_counter() - t)
            return r

        session.step = timed
        try:
            result = await generate(session, ids, params, model.eos_ids)
        finally:
            await session.close()
        gaps.extend(steps[1:])  # step 0 is this session's own prefill
        tokens += len(result.tokens)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(*s) for s in load))
    wall = time.perf_counter() - t0
    gaps.sort()
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "p95_tbt_ms": 1000 * gaps[int(0.95 * (len(gaps) - 1))], "median_tbt_ms": 1000 * statistics.median(gaps)}


def run_throttle(args) -> dict:
    """The throttling figures (see the module docstring)."""
    import runtime  # benchmarks/runtime.py: its client helpers
    from kv_paging import trace_pairs

    from p2pserve.client.generation import generate
    from p2pserve.client.model_info import LocalModelInfo
    from p2pserve.client.params import GenerationParams
    from p2pserve.launch import start_peers

    model = LocalModelInfo.load(args.model)
    L = model.spec.num_layers
    thirds = [(0, L // 3), (L // 3, 2 * L // 3), (2 * L // 3, L)]
    load = mixed_load(trace_pairs(), args.throttle_sessions, args.throttle_gap, args.throttle_max_prompt,
                      args.throttle_max_reply, model.spec.vocab_size)
    runs: dict[str, list[dict]] = {"on": [], "off": []}

    async def measure(peers):
        p2p = await runtime.create_client_p2p()
        try:
            hops = [p.hop() for p in peers]
            await runtime.stream_rate(p2p, hops, model, load[0][1][:16], 4)  # warm-up
            return await run_load(p2p, hops, model, load, runtime.open_chain_session, generate, GenerationParams)
        finally:
            await p2p.close()

    for _ in range(args.throttle_rounds):
        for mode in ("off", "on"):
            peers = start_peers(model.path, thirds, "--num-threads", str(args.threads), "--prefill-throttle", mode)
            try:
                runs[mode].append(asyncio.run(measure(peers)))
            finally:
                for p in peers:
                    p.stop()
            print(f"throttle {mode}: {runs[mode][-1]}", flush=True)

    def med(mode, key):
        return statistics.median(r[key] for r in runs[mode])

    return {
        "model": model.spec.model_id,
        "threads": args.threads,
        "sessions": len(load),
        "prompt_tokens": [len(ids) for _, ids, _ in load],
        "reply_tokens": [r for _, _, r in load],
        "arrival_s": [round(at, 2) for at, _, _ in load],
        "runs": runs,
        "throttle_on_tokens_per_s": med("on", "tokens_per_s"),
        "throttle_off_tokens_per_s": med("off", "tokens_per_s"),
        "throttle_on_p95_tbt_ms": med("on", "p95_tbt_ms"),
        "throttle_off_p95_tbt_ms": med("off", "p95_tbt_ms"),
        "throttle_p95_tbt_gain": med("off", "p95_tbt_ms") / med("on", "p95_tbt_ms"),
        "throttle_throughput_ratio": med("on", "tokens_per_s") / med("off", "tokens_per_s"),
    }
