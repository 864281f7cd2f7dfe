"""The ``batching`` section of benchmarks/runtime.py: batch forming on against off, paired.

Two sets of 3 SmolLM2 peer processes (a third of the layers each), one with ``--batch-wait-ms 0``
(each step starts on the first arrival, the default) and one with ``--batch-wait-ms``
(``--batching-wait-ms`` here, default 250; peer/batch_forming.py), measured in alternating rounds (``--batching-rounds``) so that load on a
shared machine hits both alike. Per round and arm: aggregate decode tokens/s of 1 session and of
16 concurrent sessions (`runtime.aggregate_rate`, as the default section's
``batching_gain_16_vs_1``), and the compute steps each peer ran for the 16 sessions
(``PeerStats.steps``; one per token per peer is the ideal).

* ``batching_gain_16_vs_1_batch_forming``, ``..._no_batch_forming``: median over rounds
* ``batch_forming_vs_off_16_sessions``: median of the paired per-round ratios of 16-session tokens/s
"""

from __future__ import annotations

import asyncio
import os
import statistics


async def _steps(p2p, hops) -> list[int]:
    from p2pserve.client.connection import HopConnection
    from p2pserve.config import ClientConfig
    from runtime import over

    out = []
    for hop in hops:
        conn = HopConnection(over(p2p), hop, ClientConfig().frame_limits, 10)
        try:
            out.append((await conn.stats()).steps)
        finally:
            await conn.close()
    return out


async def _round(peers, model, ids, tokens: int) -> dict:
    """1-session and 16-session aggregate tokens/s on ``peers``, and the steps the 16 took."""
    from runtime import aggregate_rate, create_client_p2p

    p2p = await create_client_p2p()
    hops = [p.hop() for p in peers]
    try:
        await aggregate_rate(p2p, hops, model, ids, 8, 4)  # warm-up
        one = await aggregate_rate(p2p, hops, model, ids, tokens, 1)
        before = await _steps(p2p, hops)
        sixteen = await aggregate_rate(p2p, hops, model, ids, tokens, 16)
        steps = [b - a for a, b in zip(before, await _steps(p2p, hops))]
        return dict(one=one, sixteen=sixteen, steps=steps, load=os.getloadavg()[0])
    finally:
        await p2p.close()


def run_batching(args) -> dict:
    """The paired batch-forming figures (see the module docstring)."""
    from p2pserve.client.model_info import LocalModelInfo
    from p2pserve.launch import start_peers
    from runtime import PROMPT

    model = LocalModelInfo.load(args.model)
    ids = model.chat_ids([{"role": "user", "content": PROMPT}])
    L = model.spec.num_layers
    thirds = [(0, L // 3), (L // 3, 2 * L // 3), (2 * L // 3, L)]
    arms = {"off": ["--batch-wait-ms", "0"], "on": ["--batch-wait-ms", str(args.batch_wait_ms)]}
    rounds = {arm: [] for arm in arms}
    for r in range(args.batching_rounds):
        for arm, flags in arms.items():
            peers = start_peers(model.path, thirds, "--num-threads", str(args.threads), *flags)
            try:
                m = asyncio.run(_round(peers, model, ids, args.tokens))
            finally:
                for p in peers:
                    p.stop()
            print(f"round {r} batch forming {arm}: 1 session {m['one']:.2f} tok/s, 16 sessions "
                  f"{m['sixteen']:.2f} tok/s, steps per peer {m['steps']}, load {m['load']:.1f}", flush=True)
            rounds[arm].append(m)
    gain = {arm: statistics.median(m["sixteen"] / m["one"] for m in ms) for arm, ms in rounds.items()}
    return {
        "batching_gain_16_vs_1_batch_forming": gain["on"],
        "batching_gain_16_vs_1_no_batch_forming": gain["off"],
        "batch_forming_vs_off_16_sessions": statistics.median(
            on["sixteen"] / off["sixteen"] for on, off in zip(rounds["on"], rounds["off"])),
        "batching_rounds": rounds,
        "decode_tokens": args.tokens,
    }
