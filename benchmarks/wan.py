"""Across a slow network: decode through 3 peers with a real one-way delay on every link.

Every peer runs behind its own delay relay (``p2pserve/testing/delay_relay.py``, started by
``p2pserve/testing/wan.py``) and announces only the relay's addresses, so every link, client to
peer and peer to peer, carries the relay's one-way delay in each direction and its rate. For
each delay (default 5, 25 and 50 ms) the benchmark starts 3 fresh peers holding a third of the
model each, and a client drives greedy decoding hop by hop (client-driven: each token costs one
client -> peer -> client round trip per hop). Against a loopback baseline (the same 3 peers, no
relay) measured in the same run, it reports:

* ``client_ms_per_token``: median time between decode tokens; ``client_tokens_per_s``: tokens
  over the whole request (prefill included, connection set-up not);
* ``ratio_vs_loopback`` of both, and ``network_floor_ms``: the round trips alone
  (hops x 2 x delay), the least any client-driven step can cost at that delay;
* ``identical``: the greedy tokens equal the loopback run's.

``speculative_speedup``: tokens/s with prompt-lookup drafting over plain decoding on a copying
workload (four prompts: two code edits returning the code, a spelling fix returning the
paragraph, a summary quoting its text; each reply up to its end of turn, at most 96 tokens;
``benchmarks/speculative.py``'s ``measure_prompts``) over the same relayed hops, total tokens over
total seconds, with ``identical`` (every prompt), the draft's acceptance, and each prompt's
figures under ``speculative.prompts``.
``push_vs_client_ms_per_token``: push mode's median ms/token over client-driven's at the same
delay, for the faster of its two variants, each measured the same way as client-driven, in
turns with it (a warm-up of each, then rounds of one request per mode: a drifting load weighs on
all modes alike), over the same peers (which meet at a bootstrap node, where each finds the next hop's announced
relay address). ``push_chain_vs_client_ms_per_token``: the chain (``p2pserve/client/push.py``:
the client sends each step to the first hop, the peers forward it to each other, the last hop
answers the client directly; network floor (hops + 1) x delay, 0.667x client-driven's
hops x 2 x delay at 3 hops). ``push_ring_vs_client_ms_per_token``: the ring
(``p2pserve/client/ring.py``: the last hop also pushes each next token to the first hop, so a
token crosses hops links, 0.5x). ``push`` holds each variant's ms/token, tokens/s, ``identical``
(its greedy tokens equal the client-driven run's) and ``network_floor_ms``, and which was ``best``.

Usage: PYTHONPATH=. python benchmarks/wan.py [--model default] [--delays 5 25 50] [--tokens 32]
       [--rate-mbps 100] [--repeats 2] [--spec-rounds 2] [--peer-threads 2] [--no-push] [--no-speculative]
       [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pserve.client.generation import Generation  # noqa: E402
from p2pserve.client.model_info import LocalModelInfo  # noqa: E402
from p2pserve.client.node import client_transport  # noqa: E402
from p2pserve.client.params import GenerationParams  # noqa: E402
from p2pserve.client.pipeline import open_chain  # noqa: E402
from p2pserve.config import PushConfig  # noqa: E402
from p2pserve.config import ClientConfig  # noqa: E402
from p2pserve.launch import start_peers  # noqa: E402
from p2pserve.model.default import resolve_model  # noqa: E402
from p2pserve.testing.wan import (  # noqa: E402
    SWARM_TIMING,
    start_bootstrap,
    start_relayed_peers,
    stop_relayed_peers,
    wait_announced,
)

PROMPT = "Explain in a few sentences why splitting a model across machines on the internet makes it slower."
CONFIG = ClientConfig(hop_timeout_s=60.0, verify_share=0.0)  # no verifier here: push is not refused


def thirds(num_layers: int) -> list[tuple[int, int]]:
    """Three contiguous ranges covering [0, num_layers)."""
    cut = [round(i * num_layers / 3) for i in range(4)]
    return [(cut[i], cut[i + 1]) for i in range(3)]


async def client_run(model: LocalModelInfo, hops, prompt_ids: list[int], tokens: int,
                     push: PushConfig = PushConfig()) -> dict:
    """One greedy request through ``hops`` (pushed when ``push`` says so): token times after the
    pipeline is open."""
    params = GenerationParams(max_new_tokens=tokens, ignore_eos=True)
    transport = await client_transport(CONFIG)
    try:
        pipeline = await open_chain(transport, hops, model.spec.model_id, model.spec.num_layers,
                                    len(prompt_ids) + tokens + 8, params.validate(), CONFIG, push)
        try:
            t0 = time.perf_counter()
            stamps = []
            gen = Generation(pipeline, prompt_ids, params, model.eos_ids)
            async for _ in gen:
                stamps.append(time.perf_counter())
            total = stamps[-1] - t0
        finally:
            await pipeline.close()
    finally:
        await transport.close()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return dict(tokens=gen.result.tokens, ms_per_token=1e3 * statistics.median(gaps),
                tokens_per_s=len(gen.result.tokens) / total, first_token_ms=1e3 * (stamps[0] - t0))


def best_of(model, hops, prompt_ids, tokens: int, repeats: int, push: PushConfig = PushConfig()) -> dict:
    """A warm-up request, then the fastest of ``repeats`` (a busy host only slows a run down)."""
    return interleaved(model, hops, prompt_ids, tokens, repeats, {"run": push})["run"]


def interleaved(model, hops, prompt_ids, tokens: int, repeats: int, modes: dict[str, PushConfig]) -> dict[str, dict]:
    """Each mode's fastest of ``repeats`` requests, after a warm-up of each; the modes take turns
    in every round, so a load that drifts during the run weighs on all of them alike."""
    for push in modes.values():
        asyncio.run(client_run(model, hops, prompt_ids, 4, push))
    runs: dict[str, list] = {name: [] for name in modes}
    for _ in range(repeats):
        for name, push in modes.items():
            runs[name].append(asyncio.run(client_run(model, hops, prompt_ids, tokens, push)))
    best = {}
    for name, done in runs.items():
        best[name] = min(done, key=lambda r: r["ms_per_token"])
        best[name]["identical_across_repeats"] = all(r["tokens"] == done[0]["tokens"] for r in done)
    return best


#: Push mode's two variants, forced on whatever the links (the rule would push them anyway).
PUSH_MODES = {"chain": PushConfig(enabled=True, min_rtt_ms=0), "ring": PushConfig(enabled=True, min_rtt_ms=0, ring=True)}


def push_figures(runs: dict[str, dict], hops, delay_ms: float) -> dict:
    """Push mode as a chain and as a ring (``runs``, measured in turns with ``runs["client"]``,
    the client-driven run over the same hops): the figures of each (``chain``, ``ring``) and of
    the faster (``best``), each ms/token over client-driven's."""
    h, client = len(hops), runs["client"]
    out = {}
    for name, links in (("chain", h + 1), ("ring", h)):
        run = runs[name]
        out[name] = dict(ms_per_token=round(run["ms_per_token"], 2), tokens_per_s=round(run["tokens_per_s"], 2),
                         vs_client_ms_per_token=round(run["ms_per_token"] / client["ms_per_token"], 3),
                         network_floor_ms=links * delay_ms, floor_vs_client_floor=round(links / (2 * h), 3),
                         identical=run["tokens"] == client["tokens"] and run["identical_across_repeats"])
    best = min(out, key=lambda k: out[k]["ms_per_token"])
    return dict(out, best=best, **{k: out[best][k] for k in ("ms_per_token", "vs_client_ms_per_token", "identical")})


def measure_speculative(model, hops, tokens: int, rounds: int = 2) -> Optional[dict]:
    """Speculative decoding (``benchmarks/speculative.py``): tokens/s with prompt-lookup drafting
    over plain one-token steps on a copying workload (``PROMPTS``: two code edits, a prose edit and
    a quoting summary, each reply ending at its end of turn), over the same relayed hops,
    alternating in ``rounds``; the whole workload's ratio with ``identical`` and the acceptance,
    and each prompt's figures under ``prompts``."""
    from speculative import measure_prompts  # benchmarks/ is sys.path[0] when run

    res = measure_prompts(model, hops, tokens=max(tokens, 96), rounds=rounds)
    return _rounded(res)


def _rounded(value):
    """``value`` with its floats to 3 decimals, nested dicts too."""
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return round(value, 3) if isinstance(value, float) else value


def peer_flags(args) -> tuple[str, ...]:
    """Flags every peer of the run gets: its torch threads."""
    return ("--num-threads", str(args.peer_threads))


def loopback(model_path: str, model, ranges, prompt_ids, args) -> dict:
    """The baseline: the same 3 peers on loopback, no relay."""
    peers = start_peers(model_path, ranges, *peer_flags(args))
    try:
        return best_of(model, [p.hop() for p in peers], prompt_ids, args.tokens, args.repeats)
    finally:
        for p in peers:
            p.stop()


def at_delay(model_path: str, model, ranges, prompt_ids, delay_ms: float, base: dict, args, workdir: Path) -> dict:
    """Fresh relayed peers at ``delay_ms``; the client-driven figures and their ratios to ``base``."""
    children, boot = (None, []) if args.no_push else start_bootstrap(workdir)  # push: the peers meet there
    try:
        peers = start_relayed_peers(model_path, ranges, *peer_flags(args),
                                    *(("--initial-peers", *boot, *SWARM_TIMING) if boot else ()),
                                    delay_ms=delay_ms, rate_mbps=args.rate_mbps, workdir=workdir)
    except BaseException:
        if children is not None:
            children.stop_all()
        raise
    try:
        if boot:  # each finds the next hop's announced address
            wait_announced(model_path, boot, [rp.peer.peer_id for rp in peers], model.spec.num_layers)
        hops = [rp.peer.hop() for rp in peers]
        runs = interleaved(model, hops, prompt_ids, args.tokens, args.repeats,
                           {"client": PushConfig(), **({} if args.no_push else PUSH_MODES)})
        run = runs["client"]
        push = None if args.no_push else push_figures(runs, hops, delay_ms)
        spec = None if args.no_speculative else measure_speculative(model, hops, args.tokens, args.spec_rounds)
        return dict(
            delay_ms=delay_ms,
            client_ms_per_token=round(run["ms_per_token"], 2),
            client_tokens_per_s=round(run["tokens_per_s"], 2),
            client_first_token_ms=round(run["first_token_ms"], 1),
            ratio_vs_loopback=dict(ms_per_token=round(run["ms_per_token"] / base["ms_per_token"], 2),
                                   tokens_per_s=round(run["tokens_per_s"] / base["tokens_per_s"], 3)),
            network_floor_ms=len(hops) * 2 * delay_ms,
            identical=run["tokens"] == base["tokens"] and run["identical_across_repeats"],
            push_vs_client_ms_per_token=push["vs_client_ms_per_token"] if push else None,  # the faster variant
            push_chain_vs_client_ms_per_token=push["chain"]["vs_client_ms_per_token"] if push else None,
            push_ring_vs_client_ms_per_token=push["ring"]["vs_client_ms_per_token"] if push else None,
            push=push,
            speculative_speedup=spec["speculative_speedup"] if spec else None,
            speculative=spec,
            relay_bytes=[sum(rp.bytes_relayed(0)) + sum(rp.bytes_relayed(1)) for rp in peers],
        )
    finally:
        stop_relayed_peers(peers)
        if children is not None:
            children.stop_all()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="checkpoint folder, or 'default' (SmolLM2-135M-Instruct)")
    ap.add_argument("--delays", nargs="+", default=["5,25,50"], help="one-way delays in ms (space- or comma-separated)")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per request")
    ap.add_argument("--rate-mbps", type=float, default=100.0, help="each relay direction's rate (0: unlimited)")
    ap.add_argument("--repeats", type=int, default=2, help="measured requests per setting (the fastest counts)")
    ap.add_argument("--peer-threads", type=int, default=2,
                    help="torch threads per peer (default 2: one sequence keeps one peer busy at a time, so each "
                         "gets the machine's two cores, as a volunteer's peer has its own machine)")
    ap.add_argument("--no-speculative", action="store_true", help="skip the speculative decoding measurement")
    ap.add_argument("--no-push", action="store_true", help="skip the push mode measurement")
    ap.add_argument("--spec-rounds", type=int, default=2,
                    help="speculative: alternating plain / prompt-lookup rounds per prompt")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    args = ap.parse_args()
    model_path = str(resolve_model(args.model))
    model = LocalModelInfo.load(model_path)
    ranges = thirds(model.spec.num_layers)
    prompt_ids = model.chat_ids([{"role": "user", "content": PROMPT}])
    base = loopback(model_path, model, ranges, prompt_ids, args)
    result = dict(model=model.spec.model_id, peers=ranges, peer_threads=args.peer_threads, tokens=args.tokens,
                  prompt_tokens=len(prompt_ids),
                  rate_mbps=args.rate_mbps, mode="client-driven",
                  loopback=dict(client_ms_per_token=round(base["ms_per_token"], 2),
                                client_tokens_per_s=round(base["tokens_per_s"], 2)),
                  delays={})
    print(f"loopback: {base['ms_per_token']:.1f} ms/token, {base['tokens_per_s']:.2f} tokens/s", flush=True)
    with tempfile.TemporaryDirectory(prefix="p2pserve-wan-") as workdir:
        for delay in (float(d) for arg in args.delays for d in arg.split(",")):
            row = at_delay(model_path, model, ranges, prompt_ids, delay, base, args, Path(workdir))
            result["delays"][f"{delay:g}"] = row
            print(f"{delay:g} ms one-way: {row['client_ms_per_token']:.1f} ms/token "
                  f"({row['ratio_vs_loopback']['ms_per_token']:.1f}x loopback; round trips alone "
                  f"{row['network_floor_ms']:.0f} ms), {row['client_tokens_per_s']:.2f} tokens/s "
                  f"({row['ratio_vs_loopback']['tokens_per_s']:.3f}x), identical={row['identical']}", flush=True)
            for name in ("chain", "ring") if row["push"] else ():
                pu = row["push"][name]
                print(f"  push ({name}): {pu['ms_per_token']:.1f} ms/token ({pu['vs_client_ms_per_token']:.2f}x "
                      f"client-driven; network floor {pu['network_floor_ms']:.0f} ms, {pu['floor_vs_client_floor']:.3f}x "
                      f"client-driven's), identical={pu['identical']}", flush=True)
            if row["push"]:
                print(f"  push_vs_client_ms_per_token (best: {row['push']['best']}): "
                      f"{row['push_vs_client_ms_per_token']:.3f}", flush=True)
            if row["speculative"]:
                sp = row["speculative"]
                print(f"  prompt-lookup speculation: {sp['speculative_speedup']:.2f}x tokens/s "
                      f"({sp['plain_tokens_per_s']:.2f} -> {sp['speculative_tokens_per_s']:.2f}), acceptance "
                      f"{sp['acceptance']:.2f}, identical={sp['identical']}", flush=True)
                for name, one in sp["prompts"].items():
                    print(f"    {name}: {one['speculative_speedup']:.2f}x ({one['tokens']} tokens, acceptance "
                          f"{one['acceptance']:.2f}, identical={one['identical']})", flush=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
