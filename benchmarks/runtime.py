"""Runtime benchmark of the inference path, every figure measured in this one run.

* single-stream tokens/s of SmolLM2 through 3 local peer processes vs single-process `generate`
* added latency per hop (ms): median per-token time through 4 peers vs 1 peer holding every
  layer, on a tiny model (compute ~1 ms/token, so the difference is the hops, not noise in compute);
  the same figure for SmolLM2 (3 peers vs 1) is reported too
* a bare client<->peer frame round trip (the cost a hop pays on the wire)
* aggregate tokens/s with 16 concurrent sessions vs 1 session (continuous batching)
* peak RSS of a peer holding a third of the layers vs one holding all of them

Usage: python benchmarks/runtime.py [--model default] [--tokens 64] [--threads 1] [--out FILE]
Peers and the baseline use the same number of torch threads (default 1: the CI machine has
two cores, and three peers plus a client share them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from p2pserve.client.chain import LocalModelInfo, create_client_p2p, open_chain_session  # noqa: E402
from p2pserve.client.connection import HopConnection  # noqa: E402
from p2pserve.client.generation import GenerationParams, generate  # noqa: E402
from p2pserve.config import ClientConfig  # noqa: E402
from p2pserve.launch import start_peers  # noqa: E402

PROMPT = "Write a short paragraph about why peer-to-peer systems are useful."


def peak_rss_mb(pid: int) -> float:
    """VmHWM of a process in MiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def baseline_generate(model: LocalModelInfo, ids: list[int], n: int, threads: int) -> float:
    """tokens/s of single-process transformers generate (greedy, fixed length)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    m = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    kwargs = dict(attention_mask=torch.ones_like(x), do_sample=False, pad_token_id=0)
    m.generate(x, max_new_tokens=4, **kwargs)  # warm-up
    t = time.perf_counter()
    out = m.generate(x, max_new_tokens=n, min_new_tokens=n, **kwargs)
    dt = time.perf_counter() - t
    return (out.shape[1] - x.shape[1]) / dt


async def stream_rate(p2p, hops, model, ids, n) -> tuple[float, float]:
    """(decode tokens/s, mean ms per decode step) of one session on ``hops``."""
    params = GenerationParams(max_new_tokens=n, ignore_eos=True)
    session = await open_chain_session(p2p, hops, model, len(ids) + n + 8, params)
    try:
        times = []
        original = session.step

        async def timed(tokens):
            t = time.perf_counter()
            r = await original(tokens)
            times.append(time.perf_counter() - t)
            return r

        session.step = timed
        await generate(session, ids, params, model.eos_ids)
        decode = times[1:]  # the first step is the prefill
        return len(decode) / sum(decode), 1000 * statistics.median(decode)
    finally:
        await session.close()


async def aggregate_rate(p2p, hops, model, ids, n, sessions) -> float:
    """Total decode tokens/s of ``sessions`` concurrent sessions."""
    params = GenerationParams(max_new_tokens=n, ignore_eos=True)
    opened = [await open_chain_session(p2p, hops, model, len(ids) + n + 8, params) for _ in range(sessions)]
    try:
        t = time.perf_counter()
        results = await asyncio.gather(*(generate(s, ids, params, model.eos_ids) for s in opened))
        dt = time.perf_counter() - t
        return sum(len(r.tokens) for r in results) / dt
    finally:
        for s in opened:
            await s.close()


async def frame_rtt_ms(p2p, hop, rounds=200) -> float:
    """Median round trip of a small control frame between the client and a peer."""
    conn = HopConnection(p2p, hop, ClientConfig().frame_limits, 10)
    await conn.stats()
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        await conn.stats()
        samples.append(time.perf_counter() - t)
    await conn.close()
    return 1000 * statistics.median(samples)


async def hop_overhead(tiny_path: str) -> dict:
    """Median ms per decode step on a tiny model: 1 peer vs a 4-peer chain of the same layers."""
    from p2pserve.client.connection import Hop

    model = LocalModelInfo.load(tiny_path)
    ids = model.chat_ids([{"role": "user", "content": "Hello! How are you today?"}])
    L = model.spec.num_layers
    peers = start_peers(tiny_path, [(0, L)] * 4)
    try:
        p2p = await create_client_p2p()
        try:
            one = [peers[0].hop()]
            q = L // 4
            four = [Hop(p.peer_id, i * q, (i + 1) * q if i < 3 else L, p.maddrs) for i, p in enumerate(peers)]
            await stream_rate(p2p, four, model, ids, 16)  # warm-up
            await stream_rate(p2p, one, model, ids, 16)
            _, ms4 = await stream_rate(p2p, four, model, ids, 128)
            _, ms1 = await stream_rate(p2p, one, model, ids, 128)
        finally:
            await p2p.shutdown()
    finally:
        for p in peers:
            p.stop()
    return dict(tiny_ms1=ms1, tiny_ms4=ms4, tiny_added_ms_per_hop=(ms4 - ms1) / 3)


async def measure(args, model, ids, peers3, full) -> dict:
    p2p = await create_client_p2p()
    try:
        hops3 = [p.hop() for p in peers3]
        await stream_rate(p2p, hops3, model, ids, 8)  # warm-up both chains
        await stream_rate(p2p, [full.hop()], model, ids, 8)
        rate3, ms3 = await stream_rate(p2p, hops3, model, ids, args.tokens)
        rate1, ms1 = await stream_rate(p2p, [full.hop()], model, ids, args.tokens)
        rtt = await frame_rtt_ms(p2p, full.hop())
        one = await aggregate_rate(p2p, hops3, model, ids, args.tokens, 1)
        sixteen = await aggregate_rate(p2p, hops3, model, ids, args.tokens, 16)
        return dict(rate3=rate3, ms3=ms3, rate1=rate1, ms1=ms1, rtt=rtt, agg1=one, agg16=sixteen)
    finally:
        await p2p.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "runtime.json"))
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model = LocalModelInfo.load(args.model)
    ids = model.chat_ids([{"role": "user", "content": PROMPT}])
    L = model.spec.num_layers
    thirds = [(0, L // 3), (L // 3, 2 * L // 3), (2 * L // 3, L)]
    peers = start_peers(model.path, [*thirds, (0, L)], "--num-threads", str(args.threads))
    try:
        m = asyncio.run(measure(args, model, ids, peers[:3], peers[3]))
        rss_third, rss_full = peak_rss_mb(peers[0].proc.pid), peak_rss_mb(peers[3].proc.pid)
    finally:
        for p in peers:
            p.stop()
    import tempfile

    from p2pserve.model.tiny import build_tiny_model

    tiny = asyncio.run(hop_overhead(str(build_tiny_model("llama", Path(tempfile.mkdtemp()) / "tiny"))))
    base = baseline_generate(model, ids, args.tokens, args.threads)
    result = {
        "model": model.spec.model_id,
        "threads": args.threads,
        "new_tokens": args.tokens,
        "single_process_generate_tokens_per_s": base,
        "three_peers_tokens_per_s": m["rate3"],
        "three_peers_vs_generate_ratio": m["rate3"] / base,
        "one_peer_tokens_per_s": m["rate1"],
        "ms_per_token_three_peers": m["ms3"],
        "ms_per_token_one_peer": m["ms1"],
        "added_ms_per_hop": tiny["tiny_added_ms_per_hop"],
        "tiny_ms_per_token_one_peer": tiny["tiny_ms1"],
        "tiny_ms_per_token_four_peers": tiny["tiny_ms4"],
        "smollm2_added_ms_per_hop": (m["ms3"] - m["ms1"]) / 2,
        "control_frame_rtt_ms": m["rtt"],
        "aggregate_tokens_per_s_1_session": m["agg1"],
        "aggregate_tokens_per_s_16_sessions": m["agg16"],
        "batching_gain_16_vs_1": m["agg16"] / m["agg1"],
        "peak_rss_mb_third_of_layers": rss_third,
        "peak_rss_mb_all_layers": rss_full,
        "rss_ratio_third_vs_all": rss_third / rss_full,
    }
    width = max(map(len, result))
    for k, v in result.items():
        print(f"{k:<{width}}  {v:.3f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
