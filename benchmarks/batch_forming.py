"""The ``batching`` section of benchmarks/runtime.py: batch forming on against off, paired.

Three sets of 3 SmolLM2 peer processes (a third of the layers each): ``off`` with
``--batch-wait-ms 0`` (each step starts on the first arrival, the default), ``on`` with
``--batch-wait-ms`` (``--batching-wait-ms`` here, default 250; peer/batch_forming.py), and
``micro`` = ``on`` plus ``--pipeline-depth`` (``--batching-depth`` here, default 3: gLLM's decode
spreading, the peers split the running sessions into that many micro-batches, one per stage by
default, so that every stage can compute at once),
measured in alternating rounds (``--batching-rounds``) so that load on a shared machine hits all
alike. Per round and arm: aggregate decode tokens/s of 1 session and of 16 concurrent sessions
(`runtime.aggregate_rate`, as the default section's ``batching_gain_16_vs_1``), the compute
steps each peer ran for the 16 sessions (``PeerStats.steps``; one per token per peer is the
ideal), and where the CPU went: CPU seconds of the peers' and the client's processes per
generated token, and the cores they kept busy (CPU seconds over wall seconds).

* ``batching_gain_16_vs_1_batch_forming``, ``..._no_batch_forming``, ``..._micro_batches``:
  median over rounds
* ``batch_forming_vs_off_16_sessions``: median of the paired per-round ratios of 16-session tokens/s
* ``batching_cpu``: per arm, median CPU ms per token and cores busy, 1 and 16 sessions
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgids: set[int]) -> float:
    """User + system CPU seconds of every live process in the process groups ``pgids`` (Linux
    /proc; a peer is started in its own group with its DHT child and libp2p daemon)."""
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) in pgids:  # fields after the name: state, ppid, pgrp, ..., utime (11), stime (12)
            total += int(fields[11]) + int(fields[12])
    return total / _TICK


async def _measured(p2p, hops, model, ids, tokens: int, sessions: int, pgids: set[int]) -> dict:
    """Aggregate tokens/s of ``sessions`` sessions and the CPU the peers and this client spent."""
    from runtime import aggregate_rate

    cpu0, t0 = group_cpu_s(pgids) + time.process_time(), time.perf_counter()
    rate = await aggregate_rate(p2p, hops, model, ids, tokens, sessions)
    cpu, wall = group_cpu_s(pgids) + time.process_time() - cpu0, time.perf_counter() - t0
    return dict(rate=rate, cpu_ms_per_token=1000 * cpu / (tokens * sessions), cores=cpu / wall)


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
    """1-session and 16-session aggregate tokens/s on ``peers``, the steps the 16 took and the CPU."""
    from runtime import aggregate_rate, create_client_p2p

    p2p = await create_client_p2p()
    hops = [p.hop() for p in peers]
    pgids = {p.proc.pid for p in peers}  # each peer leads its own process group
    try:
        await aggregate_rate(p2p, hops, model, ids, 8, 4)  # warm-up
        one = await _measured(p2p, hops, model, ids, tokens, 1, pgids)
        before = await _steps(p2p, hops)
        sixteen = await _measured(p2p, hops, model, ids, tokens, 16, pgids)
        steps = [b - a for a, b in zip(before, await _steps(p2p, hops))]
        return dict(one=one["rate"], sixteen=sixteen["rate"], steps=steps, load=os.getloadavg()[0],
                    cpu={"one": one, "sixteen": sixteen})
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
    wait = ["--batch-wait-ms", str(args.batch_wait_ms)]
    arms = {"off": ["--batch-wait-ms", "0"], "on": wait, "micro": [*wait, "--pipeline-depth", str(args.batching_depth)]}
    rounds = {arm: [] for arm in arms}
    for r in range(args.batching_rounds):
        for arm, flags in arms.items():
            peers = start_peers(model.path, thirds, "--num-threads", str(args.threads), *flags)
            try:
                m = asyncio.run(_round(peers, model, ids, args.tokens))
            finally:
                for p in peers:
                    p.stop()
            c1, c16 = m["cpu"]["one"], m["cpu"]["sixteen"]
            print(f"round {r} batch forming {arm}: 1 session {m['one']:.2f} tok/s, 16 sessions "
                  f"{m['sixteen']:.2f} tok/s, steps per peer {m['steps']}, CPU ms/token "
                  f"{c1['cpu_ms_per_token']:.1f} -> {c16['cpu_ms_per_token']:.1f}, cores busy "
                  f"{c1['cores']:.2f} -> {c16['cores']:.2f}, load {m['load']:.1f}", flush=True)
            rounds[arm].append(m)
    gain = {arm: statistics.median(m["sixteen"] / m["one"] for m in ms) for arm, ms in rounds.items()}
    return {
        "batching_gain_16_vs_1_batch_forming": gain["on"],
        "batching_gain_16_vs_1_no_batch_forming": gain["off"],
        "batching_gain_16_vs_1_micro_batches": gain["micro"],
        "batching_cpu": {arm: {f"{k}_{n}": round(statistics.median(m["cpu"][n][k] for m in ms), 3)
                               for n in ("one", "sixteen") for k in ("cpu_ms_per_token", "cores")}
                         for arm, ms in rounds.items()},
        "batch_forming_vs_off_16_sessions": statistics.median(
            on["sixteen"] / off["sixteen"] for on, off in zip(rounds["on"], rounds["off"])),
        "batching_rounds": rounds,
        "decode_tokens": args.tokens,
    }
