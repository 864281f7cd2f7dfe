"""Output verification: what it costs, how fast it catches a corrupting peer, whether it ever
blames an honest one.

Real peer processes on loopback serving the tiny seeded 8-layer Llama with fixed ranges: three
replicas of layers [0, 4) and two of [4, 8) (one torch thread each); clients over that fixed set
of peers (``AsyncClient(peers=...)``), so no control plane is involved. Figures:

* ``signing`` — per step: the peer's input commitment for one row, output digest and Ed25519
  signature, and the client's signature check, for a 4096-wide bf16 row (Llama-3-8B) and the
  tiny model's row; microbenchmarked in this process;
* ``verification_overhead`` — aggregate generated tokens/s of 4 closed-loop workers sending
  greedy requests, with verification on at the default share (``ClientConfig.verify_share``) over
  the same with it off, and with ``verify_hold`` over off, in rotating phases of 3 requests per
  worker on the same peers, each verifying phase waiting for its own checks (target >= 0.97);
  ``paired``: the ratio within each cycle of phases (median, range), which cancels load drift
  between cycles; ``cpu_ratio``: CPU seconds per token of the whole benchmark (peers, their
  libp2p daemons, the client) off over on, the work the checks add, which the load of other
  processes on the machine barely moves;
* the same for ``verify_every_request`` with ``verify_hold`` (``ratio_every``): every hop of every
  request checked before it returns (docs/trust.md, "Every request");
* ``requests_to_exclusion`` — a dishonest peer (``tests/dishonest.py``) joins as a fourth replica
  of [0, 4) and corrupts 10% of its steps; a fresh client per trial at 2% verification counts
  the requests until it bans the peer (the integration test shows the plan dropping it);
* ``false_exclusions`` — honest peers only, in fp32 and bf16, verification share 1.0 until at
  least ``--honest-steps`` hop-steps were compared: mismatches blamed (target 0), inconclusive
  disagreements, and the largest honest distance seen against its tolerance (the calibration).

Usage: python benchmarks/verification.py [--honest-steps 10000] [--trials 5] [--sections overhead,exclusion,false]
[--dtypes float32,bfloat16] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from p2pserve.client.api import AsyncClient  # noqa: E402
from p2pserve.client.model_info import LocalModelInfo  # noqa: E402
from p2pserve.client.trust.verifier import TOLERANCE  # noqa: E402
from p2pserve.config import ClientConfig  # noqa: E402
from p2pserve.launch import start_peers  # noqa: E402
from tests import dishonest  # noqa: E402

PROMPTS = [[1, 5, 9, 13], [2, 4, 8, 16, 32], [3, 7, 11], [6, 10, 20, 30, 40, 50]]
RANGES = [(0, 4), (0, 4), (0, 4), (4, 8), (4, 8)]
BASE = ClientConfig(hop_timeout_s=60.0, max_retries=3)


def signing_cost(rounds: int = 2000) -> dict:
    """Microseconds per step of what signing adds on the peer and checking adds on the client."""
    import torch

    from p2pserve.dht.evidence import InputChain, ReplyClaim, derive_reply_key, output_digest, reply_key_text, verify_claim
    from p2pserve.peer.reply_signer import ReplySigner
    from p2pserve.protocol import SamplingParams

    key = derive_reply_key(b"benchmark identity")
    signer = ReplySigner("peer", "model", key)
    out = {}
    for name, width in (("llama3_8b_bf16_row", 4096), ("tiny_fp32_row", 64)):
        dtype = torch.bfloat16 if width == 4096 else torch.float32
        row = torch.randn(1, width).to(dtype).view(torch.uint8).numpy().tobytes()
        chain, session = InputChain(), type("S", (), {"id": "s", "start": 0, "end": 4, "sampling": SamplingParams()})()
        t0 = time.perf_counter()
        for i in range(rounds):
            c = signer.consume(chain, i, row, 1)
            sig = signer.sign(session, i, 1, c, row)
        peer_us = (time.perf_counter() - t0) / rounds * 1e6
        claim = ReplyClaim(model="model", peer_id="peer", session_id="s", start=0, end=4, position=rounds - 1,
                           count=1, commitment=c, output=output_digest(row))
        pub = reply_key_text(key)
        t0 = time.perf_counter()
        for _ in range(rounds):
            assert verify_claim(pub, claim, sig)
        out[name] = {"peer_sign_us_per_step": round(peer_us, 1),
                     "client_verify_us": round((time.perf_counter() - t0) / rounds * 1e6, 1)}
    return out


def _entries(peers) -> list:
    return [(p.maddrs[0], *p.layers) for p in peers]


async def _round(client, concurrency: int, new_tokens: int, offset: int) -> tuple[int, float]:
    """``concurrency`` greedy requests at once; (tokens generated, seconds)."""
    t0 = time.perf_counter()
    replies = await asyncio.gather(*(client.generate(PROMPTS[(offset + i) % len(PROMPTS)], max_new_tokens=new_tokens,
                                                     ignore_eos=True) for i in range(concurrency)))
    return sum(len(r.tokens) for r in replies), time.perf_counter() - t0


async def _workers(client, concurrency: int, requests: int, new_tokens: int, offset: int) -> int:
    """``concurrency`` closed-loop workers, each sending ``requests`` greedy requests back to back
    (no barrier between requests: a request that waits lets the others run); tokens generated."""

    async def worker(i: int) -> int:
        n = 0
        for r in range(requests):
            reply = await client.generate(PROMPTS[(offset + i + r) % len(PROMPTS)], max_new_tokens=new_tokens,
                                          ignore_eos=True)
            n += len(reply.tokens)
        return n

    return sum(await asyncio.gather(*(worker(i) for i in range(concurrency))))


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and all its descendants (the peer processes and
    every libp2p daemon): the work the whole benchmark does, whatever else runs on the machine."""
    parents, times = {}, {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    mine, more = set(), {os.getpid()}
    while more:  # descendants, generation by generation
        mine |= more
        more = {p for p, pp in parents.items() if pp in mine} - mine
    return sum(times[p] for p in mine)


async def overhead(path, model, peers, rounds: int, concurrency: int, new_tokens: int, phase: int = 3) -> dict:
    """Aggregate tokens/s with verification at the default share over without, with
    ``verify_hold`` over without, and with ``verify_every_request`` and ``verify_hold`` over
    without ("every"). Each arm runs ``rounds`` requests per worker (``concurrency``
    closed-loop workers) in phases of ``phase``; a cycle runs one phase of each arm, in an order
    that rotates from cycle to cycle, so load drift on a shared machine hits every arm alike. A
    verifying phase ends when its last check is done, so it pays for every check it started (none
    spill into the next phase); ``drain_share`` is the part of its time spent waiting for them.
    ``paired`` gives the ratio within each cycle (median and range): the drift between cycles
    cancels there. ``cpu_ratio`` is CPU seconds per token (peers, their libp2p daemons and the
    client) off over on: the work the checks add, which other engineers' load barely moves."""
    share = ClientConfig().verify_share
    arms = {"off": replace(BASE, verify_share=0.0), "on": replace(BASE, verify_share=share),
            "hold": replace(BASE, verify_share=share, verify_hold=True),
            "every": replace(BASE, verify_share=share, verify_hold=True, verify_every_request=True)}
    totals = {k: {"tokens": 0, "s": 0.0, "drain_s": 0.0, "cpu_s": 0.0} for k in arms}
    cycles: list[dict] = []
    load = [os.getloadavg()[0]]
    clients = {k: AsyncClient(peers=_entries(peers), model=path, config=c, seed=1, model_info=model) for k, c in arms.items()}
    for c in clients.values():
        await c.start()
    try:
        for c in clients.values():  # warm-up: streams, sessions and witness sessions of every arm
            await _round(c, concurrency, 4, 0)
            if c.verifier is not None:
                await c.verifier.drain()
        names = list(arms)
        for p in range(max(1, rounds // phase)):
            cycle = {}
            for name in names[p % len(names):] + names[:p % len(names)]:
                client, cpu0, t0 = clients[name], cpu_seconds(), time.perf_counter()
                n = await _workers(client, concurrency, phase, new_tokens, p * phase)
                t1 = time.perf_counter()
                if client.verifier is not None:
                    await client.verifier.drain()
                dt = time.perf_counter() - t0
                arm = totals[name]
                arm["tokens"] += n
                arm["s"] += dt
                arm["drain_s"] += dt - (t1 - t0)
                cpu_s = cpu_seconds() - cpu0
                arm["cpu_s"] += cpu_s
                cycle[name] = n / dt
                cycle[name + "_cpu"] = cpu_s / n
            cycles.append(cycle)
        pool = clients["on"].verifier.witnesses
        stats = dict(asdict(clients["on"].verifier.stats), witness_sessions_opened=pool.opened,
                     witness_forwards=pool.forwards)
        # the swarm's extra work, independent of the machine's load: peer calls the checks made per
        # request, against the calls a request makes (an open, new_tokens Forwards, a close per hop)
        requests = max(1, rounds // phase) * phase * concurrency
        hops = len({r[1] for r in RANGES})
        stats["extra_peer_calls_share"] = round((pool.opened + pool.forwards) / requests / (hops * (new_tokens + 2)), 4)
        hold_stats = asdict(clients["hold"].verifier.stats)
    finally:
        for c in clients.values():
            await c.close()
    load.append(os.getloadavg()[0])
    tps = {k: v["tokens"] / v["s"] for k, v in totals.items()}
    cpu = {k: 1000 * v["cpu_s"] / v["tokens"] for k, v in totals.items()}

    def paired(arm: str, cpu: bool = False) -> dict:
        ratios = sorted(c["off_cpu"] / c[arm + "_cpu"] if cpu else c[arm] / c["off"] for c in cycles)
        return {"median": round(statistics.median(ratios), 4), "min": round(ratios[0], 4),
                "max": round(ratios[-1], 4), "cycles": len(ratios)}

    return {"verify_share": share, "tokens_per_s_on": round(tps["on"], 2), "tokens_per_s_off": round(tps["off"], 2),
            "tokens_per_s_hold": round(tps["hold"], 2), "tokens_per_s_every": round(tps["every"], 2), "ratio": round(tps["on"] / tps["off"], 4),
            "ratio_hold": round(tps["hold"] / tps["off"], 4), "paired": paired("on"), "paired_hold": paired("hold"),
            "cpu_ms_per_token": {k: round(v, 4) for k, v in cpu.items()},
            "cpu_ratio": round(cpu["off"] / cpu["on"], 4), "cpu_ratio_hold": round(cpu["off"] / cpu["hold"], 4),
            "cpu_paired": paired("on", cpu=True), "cpu_paired_hold": paired("hold", cpu=True),
            "ratio_every": round(tps["every"] / tps["off"], 4), "paired_every": paired("every"),
            "cpu_ratio_every": round(cpu["off"] / cpu["every"], 4), "cpu_paired_every": paired("every", cpu=True),
            "drain_share": {k: round(v["drain_s"] / v["s"], 4) for k, v in totals.items() if k != "off"},
            "load_average_1min": load, "verifier": stats, "verifier_hold": hold_stats}


async def false_exclusions(path, model, peers, dtype: str, steps: int, new_tokens: int) -> dict:
    """Honest peers verified at share 1.0 until ``steps`` hop-steps were compared."""
    config = replace(BASE, verify_share=1.0, verify_max_inflight=4)
    requests = 0
    t0 = time.perf_counter()
    async with AsyncClient(peers=_entries(peers), model=path, config=config, seed=2, model_info=model) as client:
        while client.verifier.stats.verified < steps:
            await _round(client, 2, new_tokens, requests)
            requests += 2
        await client.verifier.drain()
        st = client.verifier.stats
        return {"dtype": dtype, "verified_steps": st.verified, "requests": requests, "false_exclusions": len(client.verifier.excluded),
                "mismatches": st.mismatches, "inconclusive": st.inconclusive, "skipped": st.skipped,
                "max_honest_distance": st.max_distance.get(dtype, 0.0), "tolerance": TOLERANCE[dtype],
                "seconds": round(time.perf_counter() - t0, 1)}


async def to_exclusion(path, model, peers, bad_id: str, trials: int, new_tokens: int, cap: int = 200) -> dict:
    """Requests until a fresh client at the default share bans the corrupting peer, per trial."""
    counts = []
    for trial in range(trials):
        config = replace(BASE, verify_share=0.02)
        async with AsyncClient(peers=_entries(peers), model=path, config=config, seed=100 + trial, model_info=model) as c:
            n = 0
            while bad_id not in c.verifier.excluded and n < cap:
                await c.generate(PROMPTS[n % len(PROMPTS)], max_new_tokens=new_tokens, ignore_eos=True)
                n += 1
                if n % 10 == 0:
                    await c.verifier.drain()
            counts.append(n if bad_id in c.verifier.excluded else None)
    caught = [n for n in counts if n is not None]
    return {"corrupt_share": 0.1, "verify_share": 0.02, "new_tokens": new_tokens, "per_trial": counts,
            "median": statistics.median(caught) if caught else None, "max": max(caught) if caught else None,
            "missed": counts.count(None)}


def measure(model_path: str | None = None, *, honest_steps: int = 10_000, trials: int = 5, rounds: int = 40,
            concurrency: int = 4, new_tokens: int = 16, dtypes=("float32", "bfloat16"),
            sections=("overhead", "exclusion", "false")) -> dict:
    """Every figure of this benchmark as one JSON-ready dict (``benchmarks/trust.py`` imports it)."""
    from p2pserve.model.tiny import build_tiny_model

    path = model_path or str(build_tiny_model("llama", Path(tempfile.mkdtemp()) / "llama", seed=0))
    model = LocalModelInfo.load(path)
    out = {"model": "tiny llama, 8 layers", "peers": [list(r) for r in RANGES], "signing": signing_cost()}
    # the peer's cost per step for a Llama-3-8B-wide bf16 row (what benchmarks/trust.py summarizes)
    out["sign_us_per_step"] = out["signing"]["llama3_8b_bf16_row"]["peer_sign_us_per_step"]
    out["false_exclusions"] = {}
    for dtype in dtypes if "false" in sections else ("float32",):
        peers = start_peers(path, RANGES, "--dtype", dtype)
        try:
            if dtype == "float32" and "overhead" in sections:
                out["verification_overhead"] = asyncio.run(overhead(path, model, peers, rounds, concurrency, new_tokens))
            if dtype == "float32" and "exclusion" in sections:
                bad = dishonest.launch(path, (0, 4), 0.1, seed=7).wait_ready()
                try:
                    out["requests_to_exclusion"] = asyncio.run(
                        to_exclusion(path, model, peers + [bad], bad.peer_id, trials, new_tokens))
                finally:
                    bad.kill()
            if "false" in sections:
                out["false_exclusions"][dtype] = asyncio.run(
                    false_exclusions(path, model, peers, dtype, honest_steps, new_tokens))
        finally:
            for p in peers:
                p.kill()
    return out


def main() -> int:
    """Run :func:`measure`, print it, write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--honest-steps", type=int, default=10_000)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--sections", default="all", help="comma list of overhead,exclusion,false (default all)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma list of the dtypes the false section runs in")
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "verification.json"))
    args = ap.parse_args()
    sections = ("overhead", "exclusion", "false") if args.sections == "all" else tuple(args.sections.split(","))
    result = measure(honest_steps=args.honest_steps, trials=args.trials, rounds=args.rounds, sections=sections,
                     dtypes=tuple(args.dtypes.split(",")))
    print(json.dumps(result, indent=2))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
