"""Runtime benchmark of the inference path, every figure measured in this one run.

* single-stream tokens/s of SmolLM2 through 3 local peer processes vs single-process `generate`
* added latency per hop (ms): median per-token time through 4 peers vs 1 peer holding every
  layer, on a tiny model (compute ~1 ms/token, so the difference is the hops, not noise in compute);
  the same figure for SmolLM2 (3 peers vs 1) is reported too
* a bare client<->peer frame round trip (the cost a hop pays on the wire)
* the hop figures again with the client kept on libp2p streams (no direct TCP path)
* where the added time per hop goes: inside the peers (of which compute) vs the wire and the
  client, from the service and compute times the peers report (``PeerStats``)
* the same peer work in one process, hot: a Forward through the handler vs the forward alone
* a 2-layer forward back to back vs after other work (the cold start every hop pays once per token)
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


async def stream_rate(p2p, hops, model, ids, n, config: ClientConfig = ClientConfig()) -> tuple[float, float]:
    """(decode tokens/s, median ms per decode step) of one session on ``hops``."""
    params = GenerationParams(max_new_tokens=n, ignore_eos=True)
    session = await open_chain_session(p2p, hops, model, len(ids) + n + 8, params, config)
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


async def frame_rtt_ms(p2p, hop, rounds=200, direct: bool = True) -> float:
    """Median round trip of a small control frame between the client and a peer."""
    conn = HopConnection(p2p, hop, ClientConfig().frame_limits, 10, direct=direct)
    await conn.stats()
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        await conn.stats()
        samples.append(time.perf_counter() - t)
    await conn.close()
    return 1000 * statistics.median(samples)


async def peer_timing(p2p, hops) -> list[tuple[float, float]]:
    """(service_ms, compute_ms) each hop's peer reports for its recent Forwards."""
    out = []
    for hop in hops:
        conn = HopConnection(p2p, hop, ClientConfig().frame_limits, 10)
        try:
            st = await conn.stats()
            out.append((st.service_ms, st.compute_ms))
        finally:
            await conn.close()
    return out


async def hop_overhead(tiny_path: str, rounds: int = 5) -> dict:
    """Median ms per decode step on a tiny model: 1 peer vs a 4-peer chain of the same layers.

    Measured over the direct TCP path (the default) and over libp2p streams only, in
    alternating rounds so that both see the same machine load; each figure is the median of
    the rounds.
    """
    from p2pserve.client.connection import Hop

    model = LocalModelInfo.load(tiny_path)
    ids = model.chat_ids([{"role": "user", "content": "Hello! How are you today?"}])
    L = model.spec.num_layers
    peers = start_peers(tiny_path, [(0, L)] * 4)
    transports = {"direct": ClientConfig(), "libp2p": ClientConfig(direct=False)}
    samples = {(t, k): [] for t in transports for k in (1, 4)}
    timing = {1: [], 4: []}  # per round: [(service_ms, compute_ms) per hop], direct path
    try:
        p2p = await create_client_p2p()
        try:
            one = [peers[0].hop()]
            q = L // 4
            four = [Hop(p.peer_id, i * q, (i + 1) * q if i < 3 else L, p.maddrs) for i, p in enumerate(peers)]
            for config in transports.values():  # warm-up
                await stream_rate(p2p, four, model, ids, 16, config)
                await stream_rate(p2p, one, model, ids, 16, config)
            for _ in range(rounds):
                for name, config in transports.items():
                    samples[(name, 4)].append((await stream_rate(p2p, four, model, ids, 96, config))[1])
                    if name == "direct":  # peers report medians of their last 64 Forwards: this run's
                        timing[4].append(await peer_timing(p2p, four))
                    samples[(name, 1)].append((await stream_rate(p2p, one, model, ids, 96, config))[1])
                    if name == "direct":
                        timing[1].append(await peer_timing(p2p, one))
        finally:
            await p2p.shutdown()
    finally:
        for p in peers:
            p.stop()
    out = {}
    for name in transports:
        ms1, ms4 = statistics.median(samples[(name, 1)]), statistics.median(samples[(name, 4)])
        out[name] = dict(ms1=ms1, ms4=ms4, added_ms_per_hop=(ms4 - ms1) / 3)
    # Where the added time goes, per added hop: the peers' own time (service: frame read to
    # reply written; compute: the shard's forward) summed over the chain, minus the single
    # peer's; the rest of the added time is the wire and the client.
    def total(k: int, field: int) -> float:
        return statistics.median(sum(hop[field] for hop in r) for r in timing[k])

    out["breakdown"] = dict(
        peer_ms_per_added_hop=(total(4, 0) - total(1, 0)) / 3,
        compute_ms_per_added_hop=(total(4, 1) - total(1, 1)) / 3,
        single_peer_service_ms=total(1, 0),
        single_peer_compute_ms=total(1, 1),
        chain_service_ms=[round(statistics.median(r[i][0] for r in timing[4]), 3) for i in range(4)],
        chain_compute_ms=[round(statistics.median(r[i][1] for r in timing[4]), 3) for i in range(4)],
    )
    return out


def cold_forward_ms(tiny_path: str, rounds: int = 200) -> dict:
    """In-process: median ms of one 2-layer decode forward back to back, and after 2 ms of other
    Python work. A peer in a chain runs its layers once per token after idling while the
    other hops ran, so it pays the second figure; a single process running every layer back to
    back pays it about once per token, not once per hop."""
    from p2pserve.model.shard import Segment, Shard
    from p2pserve.model.spec import load_spec
    from p2pserve.peer.kv_cache import SequenceCache

    torch.set_num_threads(1)
    spec = load_spec(tiny_path)
    shard = Shard.load(tiny_path, spec, 2, 4)
    cache = SequenceCache(2, 4, spec.num_kv_heads, spec.head_dim, 4 * rounds, torch.float32)
    shard.forward_batch([Segment(torch.randn(16, spec.hidden_size), 0, 2, 4, cache)])

    def timed(busy_s: float) -> float:
        samples = []
        for _ in range(rounds):
            end = time.perf_counter() + busy_s
            while time.perf_counter() < end:  # other work evicts the forward's code and data
                pass
            x = torch.randn(1, spec.hidden_size)
            t = time.perf_counter()
            shard.forward_batch([Segment(x, cache.length, 2, 4, cache)])
            samples.append(time.perf_counter() - t)
        return 1000 * statistics.median(samples)

    return dict(back_to_back=timed(0.0), after_other_work=timed(0.002))


def hot_dispatch_ms(tiny_path: str, rounds: int = 1500) -> dict:
    """In-process and hot: median ms a peer's handler takes for one decode Forward of a 2-layer
    span (decode, checks, the step, encoding the reply), against the shard's forward alone. The
    difference is the peer's per-hop work outside compute when nothing has evicted it."""
    import msgspec

    from p2pserve.config import PeerConfig
    from p2pserve.model.shard import TORCH_DTYPES, Segment, Shard
    from p2pserve.model.spec import load_spec
    from p2pserve.peer.batcher import TokenThrottle
    from p2pserve.peer.handlers import SessionHandler
    from p2pserve.peer.kv_cache import KVBudget
    from p2pserve.peer.sessions import SessionTable
    from p2pserve.peer.worker import ComputeWorker
    from p2pserve.protocol import PROTOCOL_VERSION, Forward, OpenSession, SamplingParams, encode_frame
    from p2pserve.transport import tensor_to_wire

    torch.set_num_threads(1)
    spec = load_spec(tiny_path)
    cfg = PeerConfig(model=tiny_path)
    shard = Shard.load(tiny_path, spec, 2, 4)
    budget = KVBudget(10**6)
    table = SessionTable(spec=spec, served=(2, 4), budget=budget, idle_timeout_s=600, max_sessions=8,
                         torch_dtype=TORCH_DTYPES[spec.dtype], device="cpu")
    worker = ComputeWorker(shard, TokenThrottle(cfg.batching), budget)
    worker.start()
    handler = SessionHandler(spec, table, worker, cfg.frame_limits, 60)
    enc = msgspec.msgpack.Encoder()
    meta, data = tensor_to_wire(torch.randn(1, spec.hidden_size))
    data = bytes(data)
    max_len = 256

    async def run() -> tuple[float, float]:
        owner = object()
        opened = OpenSession(version=PROTOCOL_VERSION, model_id=spec.model_id, session_id="s", start=2, end=4,
                             max_length=max_len, sampling=SamplingParams())
        await handler._dispatch(enc.encode(opened), b"", owner)
        session = table.get("s")
        handled, alone = [], []
        for i in range(rounds):
            pos = i % max_len
            if pos == 0:
                session.cache.truncate(0)
            header = enc.encode(Forward(session_id="s", step=i, position=pos, tensor=meta))
            t = time.perf_counter()
            reply, payload = await handler._dispatch(header, data, owner)
            encode_frame(reply, payload)
            handled.append(time.perf_counter() - t)
        for i in range(rounds):
            pos = i % max_len
            if pos == 0:
                session.cache.truncate(0)
            x = torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(1, -1)
            t = time.perf_counter()
            shard.forward_batch([Segment(x, pos, 2, 4, session.cache)])
            alone.append(time.perf_counter() - t)
        skip = rounds // 5  # warm-up
        return 1000 * statistics.median(handled[skip:]), 1000 * statistics.median(alone[skip:])

    try:
        handled_ms, forward_ms = asyncio.run(run())
    finally:
        worker.stop()
    return dict(handled=handled_ms, forward=forward_ms, overhead=handled_ms - forward_ms)


async def measure(args, model, ids, peers3, full) -> dict:
    p2p = await create_client_p2p()
    try:
        hops3 = [p.hop() for p in peers3]
        await stream_rate(p2p, hops3, model, ids, 8)  # warm-up both chains
        await stream_rate(p2p, [full.hop()], model, ids, 8)
        rate3, ms3 = await stream_rate(p2p, hops3, model, ids, args.tokens)
        rate1, ms1 = await stream_rate(p2p, [full.hop()], model, ids, args.tokens)
        rtt = await frame_rtt_ms(p2p, full.hop())
        rtt_libp2p = await frame_rtt_ms(p2p, full.hop(), direct=False)
        one = await aggregate_rate(p2p, hops3, model, ids, args.tokens, 1)
        sixteen = await aggregate_rate(p2p, hops3, model, ids, args.tokens, 16)
        return dict(rate3=rate3, ms3=ms3, rate1=rate1, ms1=ms1, rtt=rtt, rtt_libp2p=rtt_libp2p, agg1=one, agg16=sixteen)
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

    tiny_path = str(build_tiny_model("llama", Path(tempfile.mkdtemp()) / "tiny"))
    tiny = asyncio.run(hop_overhead(tiny_path))
    cold = cold_forward_ms(tiny_path)
    hot = hot_dispatch_ms(tiny_path)
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
        "added_ms_per_hop": tiny["direct"]["added_ms_per_hop"],
        "tiny_ms_per_token_one_peer": tiny["direct"]["ms1"],
        "tiny_ms_per_token_four_peers": tiny["direct"]["ms4"],
        "added_ms_per_hop_libp2p_only": tiny["libp2p"]["added_ms_per_hop"],
        "tiny_ms_per_token_one_peer_libp2p_only": tiny["libp2p"]["ms1"],
        "tiny_ms_per_token_four_peers_libp2p_only": tiny["libp2p"]["ms4"],
        "added_ms_per_hop_in_peers": tiny["breakdown"]["peer_ms_per_added_hop"],
        "added_ms_per_hop_in_compute": tiny["breakdown"]["compute_ms_per_added_hop"],
        "added_ms_per_hop_wire_and_client": tiny["direct"]["added_ms_per_hop"] - tiny["breakdown"]["peer_ms_per_added_hop"],
        "tiny_single_peer_service_ms": tiny["breakdown"]["single_peer_service_ms"],
        "tiny_single_peer_compute_ms": tiny["breakdown"]["single_peer_compute_ms"],
        "tiny_chain_service_ms_per_peer": tiny["breakdown"]["chain_service_ms"],
        "tiny_chain_compute_ms_per_peer": tiny["breakdown"]["chain_compute_ms"],
        "hot_forward_handled_ms_in_process": hot["handled"],
        "hot_2_layer_forward_ms_in_process": hot["forward"],
        "hot_peer_work_outside_compute_ms": hot["overhead"],
        "tiny_2_layer_forward_ms_back_to_back": cold["back_to_back"],
        "tiny_2_layer_forward_ms_after_other_work": cold["after_other_work"],
        "smollm2_added_ms_per_hop": (m["ms3"] - m["ms1"]) / 2,
        "control_frame_rtt_ms": m["rtt"],
        "control_frame_rtt_ms_libp2p_only": m["rtt_libp2p"],
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
