"""Peer-driven decode against client-driven decode on one peer holding every layer.

One ``p2pserve peer`` process holds the whole model; a Python client (``AsyncClient``) runs N
concurrent greedy generations through it, in alternating rounds with the loop on (the default:
the peer samples each token and runs the next step itself, ``PushConfig.loop``) and off (the
client sends every token back, ``--no-loop``). Each round reports aggregate tokens/s and the
peer's own counters over the round: steps run and tokens per step (how many sessions each
step carried). The ratios loop / driven are computed from rounds of the same run.

Usage: python benchmarks/peer_loop.py [--model default] [--sessions 16] [--tokens 32]
[--rounds 2] [--dtype bfloat16] [--threads 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

from p2pserve.client.api import AsyncClient
from p2pserve.client.connection import HopConnection
from p2pserve.config import ClientConfig, PushConfig
from p2pserve.launch import PeerProcess
from p2pserve.model.default import resolve_model


async def _stats(transport, peer):
    link = HopConnection(transport, peer.hop(), ClientConfig().frame_limits, 30.0)
    try:
        return await link.stats()
    finally:
        await link.close()


async def one_round(model: str, peer, loop: bool, sessions: int, tokens: int) -> dict:
    """N concurrent generations with the loop on or off: tokens/s and the peer's step counters."""
    config = ClientConfig(verify_share=0.0, push=PushConfig(loop=loop))
    entries = [(peer.maddrs[0], *peer.layers)]
    async with AsyncClient(peers=entries, model=model, config=config, seed=1) as client:
        await client.generate([1, 2, 3, 4], max_new_tokens=4, ignore_eos=True)  # warm: connections, caches
        before = await _stats(client._transport, peer)
        t0 = time.perf_counter()
        await asyncio.gather(*(client.generate([1 + i, 5, 9, 13, 17, 21], max_new_tokens=tokens, ignore_eos=True)
                               for i in range(sessions)))
        seconds = time.perf_counter() - t0
        after = await _stats(client._transport, peer)
    steps, run = after.steps - before.steps, after.tokens - before.tokens
    return {"loop": loop, "seconds": round(seconds, 2), "tok_s": round(sessions * tokens / seconds, 2),
            "steps": steps, "tokens_per_step": round(run / max(steps, 1), 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="loop on / off rounds, alternating")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "peer_loop.json"))
    args = ap.parse_args()
    model = str(resolve_model(args.model))
    layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
    peer = PeerProcess.launch(model, (0, layers), "--dtype", args.dtype, threads=args.threads)
    rows = []
    try:
        peer.wait_ready(600)
        for _ in range(args.rounds):
            for loop in (True, False):
                row = asyncio.run(one_round(model, peer, loop, args.sessions, args.tokens))
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        peer.stop()

    def median(loop: bool, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["loop"] is loop)

    result = {"model": model, "sessions": args.sessions, "tokens": args.tokens, "dtype": args.dtype,
              "threads": args.threads, "load_average": os.getloadavg(), "rows": rows,
              "tok_s_ratio": round(median(True, "tok_s") / median(False, "tok_s"), 3),
              "tokens_per_step_ratio": round(median(True, "tokens_per_step") / median(False, "tokens_per_step"), 3),
              "steps_ratio": round(median(True, "steps") / median(False, "steps"), 3)}
    print(f"loop / driven, {args.sessions} sessions: tok/s x{result['tok_s_ratio']}, "
          f"tokens per step x{result['tokens_per_step_ratio']}, steps x{result['steps_ratio']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
