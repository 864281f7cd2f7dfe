"""Runtime benchmark of the inference path, every figure measured in this one run.

* single-stream tokens/s of SmolLM2 through 3 local peer processes vs single-process `generate`,
  both timed alike: decode only (prefill left out on both sides), and with the prefill
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

Other sections (``--sections``, comma-separated; the default runs everything above):

* ``hop``: only the tiny-model figures (added latency per hop, its peer-side breakdown, the
  frame round trip to a tiny peer, the in-process hot / cold forwards); needs no download.
* ``kv``: the paged KV cache (benchmarks/kv_paging.py): sessions a peer holds with the same KV
  memory under the paged cache over today's per-session reservation, on (prompt, reply) lengths
  from the Azure conversation trace (``admitted_sessions_vs_reservation``), and aggregate decode
  tokens/s of 16 sessions over 1 through an in-process SmolLM2 shard, paged exact (grouped by
  shape), paged padded (one SDPA call per layer) and per sequence, in the same run. In-process, no peers: a few minutes on 2 cores.
* ``throttle``: gLLM token throttling with chunked prefill on against off (``--prefill-throttle``)
  on a 3-peer SmolLM2 pipeline under a mixed load of trace-drawn prompts and replies arriving
  over time (benchmarks/throttle.py): ``throttle_p95_tbt_gain``, ``throttle_throughput_ratio``.
* ``batching``: batch forming (peer/batch_forming.py, ``--batch-wait-ms``) on against off, and
  with gLLM's micro-batches (``--pipeline-depth``, ``--batching-depth``), paired in alternating rounds on three sets
  of 3 SmolLM2 peers (benchmarks/batch_forming.py): the 16-vs-1 session gain of each, the paired
  16-session ratio, the steps each peer ran, and the CPU per token and cores busy.
* ``llama3``: a random-initialised bf16 model shaped like Llama-3-8B (``--shape tiny``: a
  2-layer, hidden-256 version of it, to try the path on a CPU), built once into ``--model-dir``
  (safetensors), served by 2 peer processes on ``--device`` (layers [0, L/2) and [L/2, L)),
  against single-process ``generate`` on the same weights and device: decode tokens/s and ms
  per token of each, whether the greedy tokens agree, a 1-peer chain of every layer, and
  aggregate tokens/s with ``--sessions`` concurrent sessions vs 1. Driven with random token
  ids (no tokenizer). ``--device cuda`` alone selects this section.

  python benchmarks/runtime.py --sections hop
  python benchmarks/runtime.py --device cuda --tokens 128 --model-dir /dev/shm/llama3-8b-random
  python benchmarks/runtime.py --device cpu --sections llama3 --shape tiny   # CPU try-out

``--copy-to DIR`` also writes the JSON into DIR.
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

from p2pserve.client.connection import HopConnection  # noqa: E402
from p2pserve.client.generation import generate  # noqa: E402
from p2pserve.client.model_info import LocalModelInfo  # noqa: E402
from p2pserve.client.params import GenerationParams  # noqa: E402
from p2pserve.client.pipeline import open_chain  # noqa: E402
from p2pserve.config import ClientConfig  # noqa: E402
from p2pserve.launch import start_peers  # noqa: E402
from p2pserve.transport.libp2p import Libp2pTransport  # noqa: E402
from p2pserve.transport.tcp import DirectTransport  # noqa: E402

from batch_forming import run_batching  # noqa: E402  (benchmarks/batch_forming.py)
from kv_paging import run_kv  # noqa: E402  (benchmarks/kv_paging.py)
from throttle import run_throttle  # noqa: E402  (benchmarks/throttle.py)

PROMPT = "Write a short paragraph about why peer-to-peer systems are useful."


def peak_rss_mb(pid: int) -> float:
    """VmHWM of a process in MiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def create_client_p2p() -> Libp2pTransport:
    """The client's libp2p node (``close()`` it); :func:`over` adds the direct path per config."""
    return await Libp2pTransport.create()


def over(p2p: Libp2pTransport, config: ClientConfig = ClientConfig()):
    """The transport a client with ``config`` dials through: the direct TCP path unless disabled."""
    return DirectTransport(p2p, config.frame_limits, config.direct_connect_timeout_s) if config.direct else p2p


async def open_chain_session(p2p, hops, model, max_length, params, config: ClientConfig = ClientConfig()):
    """An opened pipeline over the explicit chain ``hops``."""
    spec = model.spec
    return await open_chain(over(p2p, config), hops, spec.model_id, spec.num_layers, max_length, params.validate(),
                            config)


def baseline_generate(model: LocalModelInfo, ids: list[int], n: int, threads: int) -> dict:
    """Single-process transformers generate (greedy, fixed length), timed as the swarm is:
    ``decode_tokens_per_s`` leaves the prefill out (n tokens' time minus one token's, the prefill
    and the first token, over n - 1 tokens; best of 3 each), ``tokens_per_s_incl_prefill`` keeps it."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    m = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    kwargs = dict(attention_mask=torch.ones_like(x), do_sample=False, pad_token_id=0)
    m.generate(x, max_new_tokens=4, **kwargs)  # warm-up

    def timed(k: int) -> float:
        t = time.perf_counter()
        m.generate(x, max_new_tokens=k, min_new_tokens=k, **kwargs)
        return time.perf_counter() - t

    t1 = min(timed(1) for _ in range(3))
    tn = min(timed(n) for _ in range(3))
    return dict(decode_tokens_per_s=(n - 1) / max(tn - t1, 1e-9), tokens_per_s_incl_prefill=n / tn)


async def timed_generation(p2p, hops, model, ids, n, config: ClientConfig = ClientConfig()) -> tuple[list[int], list[float]]:
    """(generated tokens, seconds of every step) of one greedy session on ``hops``; step 0 is the prefill."""
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
        result = await generate(session, ids, params, model.eos_ids)
        return result.tokens, times
    finally:
        await session.close()


async def stream_rate(p2p, hops, model, ids, n, config: ClientConfig = ClientConfig()) -> tuple[float, float]:
    """(decode tokens/s, median ms per decode step) of one session on ``hops``; the prefill's
    rate (every step) is `stream_rate_incl_prefill`."""
    _, times = await timed_generation(p2p, hops, model, ids, n, config)
    decode = times[1:]  # the first step is the prefill
    return len(decode) / sum(decode), 1000 * statistics.median(decode)


async def stream_rate_incl_prefill(p2p, hops, model, ids, n) -> float:
    """tokens/s of one session on ``hops``, its prefill step included (generate's other timing)."""
    tokens, times = await timed_generation(p2p, hops, model, ids, n)
    return len(tokens) / sum(times)


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
    conn = HopConnection(over(p2p, ClientConfig(direct=direct)), hop, ClientConfig().frame_limits, 10)
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
        conn = HopConnection(over(p2p), hop, ClientConfig().frame_limits, 10)
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
    from p2pserve.client.hop import Hop

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
            await p2p.close()
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
    from p2pserve.model.shard import Segment, Shard
    from p2pserve.model.spec import load_spec
    from p2pserve.peer.inbound import InboundStream
    from p2pserve.peer.runtime import build_runtime
    from p2pserve.protocol import PROTOCOL_VERSION, Forward, OpenSession, SamplingParams, decode_request, encode_frame
    from p2pserve.transport.frames import tensor_to_wire
    from p2pserve.transport.memory import MemoryNetwork

    torch.set_num_threads(1)
    spec = load_spec(tiny_path)
    cfg = PeerConfig(model=tiny_path, kv_budget_token_layers=10**6, session_idle_timeout_s=600, max_sessions=8,
                     request_timeout_s=60)
    shard = Shard.load(tiny_path, spec, 2, 4)
    rt = build_runtime(cfg, spec, "bench", MemoryNetwork().transport("bench"),  # pushes nowhere: no resolver
                       shard=shard, served=(2, 4))
    table, worker, handler = rt.table, rt.worker, rt.handler
    worker.start()
    enc = msgspec.msgpack.Encoder()
    meta, data = tensor_to_wire(torch.randn(1, spec.hidden_size))
    data = bytes(data)
    max_len = 256

    async def run() -> tuple[float, float]:
        owner = InboundStream("bench")  # the handler's per-stream state, as handle_stream makes it
        opened = OpenSession(version=PROTOCOL_VERSION, model_id=spec.model_id, session_id="s", start=2, end=4,
                             max_length=max_len, sampling=SamplingParams())
        await handler._dispatch(opened, b"", owner)
        session = table.get("s", owner)
        handled, alone = [], []
        for i in range(rounds):
            pos = i % max_len
            if pos == 0:
                session.cache.truncate(0)
            header = enc.encode(Forward(session_id="s", step=i, position=pos, tensor=meta))
            t = time.perf_counter()
            reply, payload = await handler._dispatch(decode_request(header), data, owner)
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
        rate3_prefill = await stream_rate_incl_prefill(p2p, hops3, model, ids, args.tokens)
        rtt = await frame_rtt_ms(p2p, full.hop())
        rtt_libp2p = await frame_rtt_ms(p2p, full.hop(), direct=False)
        one = await aggregate_rate(p2p, hops3, model, ids, args.tokens, 1)
        sixteen = await aggregate_rate(p2p, hops3, model, ids, args.tokens, 16)
        return dict(rate3=rate3, rate3_prefill=rate3_prefill, ms3=ms3, rate1=rate1, ms1=ms1, rtt=rtt, rtt_libp2p=rtt_libp2p, agg1=one, agg16=sixteen)
    finally:
        await p2p.close()


def tiny_figures(tiny: dict, cold: dict, hot: dict) -> dict:
    """The tiny-model figures of a run: added latency per hop (direct and libp2p), where it goes,
    and the in-process hot / cold forwards."""
    return {
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
    }


def run_default(args) -> dict:
    """Every section on SmolLM2 and the tiny model (the default run)."""
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
        # Both sides timed alike: decode only (the swarm's step 0, generate's first token and
        # prefill, left out), and every token with the prefill.
        "single_process_generate_tokens_per_s": base["decode_tokens_per_s"],
        "single_process_generate_tokens_per_s_incl_prefill": base["tokens_per_s_incl_prefill"],
        "three_peers_tokens_per_s": m["rate3"],
        "three_peers_tokens_per_s_incl_prefill": m["rate3_prefill"],
        "three_peers_vs_generate_ratio": m["rate3"] / base["decode_tokens_per_s"],
        "three_peers_vs_generate_ratio_incl_prefill": m["rate3_prefill"] / base["tokens_per_s_incl_prefill"],
        "one_peer_tokens_per_s": m["rate1"],
        "ms_per_token_three_peers": m["ms3"],
        "ms_per_token_one_peer": m["ms1"],
        **tiny_figures(tiny, cold, hot),
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
    return result


# Llama-3-8B's shape (random weights, bf16). "tiny" keeps the family and vocabulary but is small
# enough to try the whole section on a CPU in seconds.
LLAMA3_SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2),
}
LLAMA3_COMMON = dict(vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False,
                     bos_token_id=128000, eos_token_id=128001, hidden_act="silu")


def build_random_llama(out: Path, shape: str, device: str, seed: int = 0):
    """Write a seeded random bf16 Llama-3-shaped model to ``out`` (safetensors), unless there.

    Returns (path, model): the model built on ``device`` (reused as the baseline), or None
    when the folder already held one. Initialising on the GPU takes seconds for 8B parameters.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out, None
    config = AutoConfig.for_model("llama", **LLAMA3_COMMON, **LLAMA3_SHAPES[shape])
    torch.manual_seed(seed)
    t = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to(device).eval()  # in case a version built it elsewhere
    sync(device)
    t_init = time.perf_counter() - t
    t = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    print(f"built {shape} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params) in {t_init:.1f} s, "
          f"saved to {out} in {time.perf_counter() - t:.1f} s", flush=True)
    return out, model


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def baseline_generate_timed(m, ids: list[int], n: int, device: str, reps: int = 3) -> dict:
    """Single-process greedy ``generate`` (no EOS stop): tokens, and decode ms per token from the
    time of n new tokens minus the time of 1 (the prefill), median of ``reps`` each."""
    m.generation_config.eos_token_id = None  # fixed length, and no EOS masking (the swarm runs ignore_eos)
    x = torch.tensor([ids], device=device)
    kwargs = dict(attention_mask=torch.ones_like(x), do_sample=False, pad_token_id=0)

    def run(k: int) -> tuple[float, torch.Tensor]:
        sync(device)
        t = time.perf_counter()
        out = m.generate(x, max_new_tokens=k, **kwargs)
        sync(device)
        return time.perf_counter() - t, out

    with torch.inference_mode():
        run(4)  # warm-up
        t1 = statistics.median(run(1)[0] for _ in range(reps))
        full = [run(n) for _ in range(reps)]
    tn = statistics.median(t for t, _ in full)
    out = full[0][1]
    assert out.shape[1] - x.shape[1] == n, out.shape
    decode_ms = 1000 * (tn - t1) / (n - 1)
    return dict(tokens=out[0, x.shape[1]:].tolist(), decode_ms_per_token=decode_ms,
                decode_tokens_per_s=1000 / decode_ms, prefill_plus_1_ms=1000 * t1, total_ms=1000 * tn,
                tokens_per_s_incl_prefill=n / tn)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token of two equal-length runs, or None if they agree."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


async def llama3_measure(args, model, ids, two, one, reps: int = 3) -> dict:
    p2p = await create_client_p2p()
    try:
        chains = {"two_peers": [p.hop() for p in two]}
        if one is not None:
            chains["one_peer"] = [one.hop()]
        out = {}
        for name, hops in chains.items():
            await stream_rate(p2p, hops, model, ids, 8)  # warm-up
            runs = [await timed_generation(p2p, hops, model, ids, args.tokens) for _ in range(reps)]
            rates = [len(t[1:]) / sum(t[1:]) for _, t in runs]
            mss = [1000 * statistics.median(t[1:]) for _, t in runs]
            out[name] = dict(tokens=runs[0][0], decode_tokens_per_s=statistics.median(rates),
                             median_ms_per_token=statistics.median(mss),
                             prefill_ms=1000 * statistics.median(t[0] for _, t in runs),
                             runs_agree=all(r[0] == runs[0][0] for r in runs))
            out[name]["peer_service_compute_ms"] = await peer_timing(p2p, hops)
        out["rtt"] = await frame_rtt_ms(p2p, chains["two_peers"][0])
        out["agg1"] = await aggregate_rate(p2p, chains["two_peers"], model, ids, args.tokens, 1)
        out["aggN"] = await aggregate_rate(p2p, chains["two_peers"], model, ids, args.tokens, args.sessions)
        return out
    finally:
        await p2p.close()


def run_llama3(args) -> dict:
    """Random Llama-3-8B-shaped bf16 model: 2 peer processes vs single-process generate."""
    import gc
    import platform

    from p2pserve.model.default import cache_dir
    from p2pserve.model.spec import load_spec

    device = "cuda" if args.device == "cuda" else "cpu"
    if device == "cpu":
        torch.set_num_threads(args.threads)
    out_dir = Path(args.model_dir) if args.model_dir else cache_dir() / f"bench-{args.shape}-random-bf16"
    t0 = time.perf_counter()
    path, m = build_random_llama(out_dir, args.shape, device)
    build_s = time.perf_counter() - t0
    spec = load_spec(path, dtype="bfloat16")
    L = spec.num_layers
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
    # Baseline first, alone on the device; then free it before the peers load.
    if m is None:
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to(device).eval()
    base = baseline_generate_timed(m, ids, args.tokens, device)
    print(f"generate: {base['decode_ms_per_token']:.2f} ms/token", flush=True)
    del m
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    model = LocalModelInfo(str(path), spec, None, set())  # ids in, ids out: no tokenizer
    extra = ("--device", device, "--dtype", "bfloat16", "--num-threads", str(args.threads))
    ranges = [(0, L // 2), (L // 2, L)] + ([] if args.no_one_peer else [(0, L)])
    t0 = time.perf_counter()
    peers = start_peers(str(path), ranges, *extra, ready_timeout=600.0)  # 8B parameters take a while to load
    load_s = time.perf_counter() - t0
    print(f"peers ready in {load_s:.1f} s", flush=True)
    try:
        r = asyncio.run(llama3_measure(args, model, ids, peers[:2], None if args.no_one_peer else peers[2]))
        rss = [peak_rss_mb(p.proc.pid) for p in peers]
        gpu_mem = None
        if device == "cuda":
            import subprocess

            gpu_mem = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"],
                                     capture_output=True, text=True).stdout.strip()
    finally:
        for p in peers:
            p.stop()
    two = r["two_peers"]
    result = {
        "section": "llama3",
        "shape": args.shape,
        "config": {**LLAMA3_COMMON, **LLAMA3_SHAPES[args.shape]},
        "device": torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "dtype": "bfloat16",
        "peer_threads": args.threads,
        "prompt_tokens": len(ids),
        "new_tokens": args.tokens,
        "build_or_reuse_s": build_s,
        "peers_ready_s": load_s,
        "generate_decode_ms_per_token": base["decode_ms_per_token"],
        "generate_decode_tokens_per_s": base["decode_tokens_per_s"],
        "generate_prefill_plus_1_token_ms": base["prefill_plus_1_ms"],
        "generate_tokens_per_s_incl_prefill": base["tokens_per_s_incl_prefill"],
        "two_peers_decode_tokens_per_s": two["decode_tokens_per_s"],
        "two_peers_median_ms_per_token": two["median_ms_per_token"],
        "two_peers_prefill_ms": two["prefill_ms"],
        "two_peers_vs_generate_ratio": two["decode_tokens_per_s"] / base["decode_tokens_per_s"],
        "two_peers_peer_service_compute_ms": two["peer_service_compute_ms"],
        "two_peers_runs_agree": two["runs_agree"],
        "first_difference_two_peers_vs_generate": first_difference(two["tokens"], base["tokens"]),
    }
    if "one_peer" in r:
        one = r["one_peer"]
        result.update({
            "one_peer_decode_tokens_per_s": one["decode_tokens_per_s"],
            "one_peer_median_ms_per_token": one["median_ms_per_token"],
            "one_peer_vs_generate_ratio": one["decode_tokens_per_s"] / base["decode_tokens_per_s"],
            "one_peer_peer_service_compute_ms": one["peer_service_compute_ms"],
            "added_ms_two_peers_vs_one_peer": two["median_ms_per_token"] - one["median_ms_per_token"],
            "first_difference_one_peer_vs_generate": first_difference(one["tokens"], base["tokens"]),
            "first_difference_two_peers_vs_one_peer": first_difference(two["tokens"], one["tokens"]),
        })
    result.update({
        "control_frame_rtt_ms": r["rtt"],
        "aggregate_tokens_per_s_1_session": r["agg1"],
        f"aggregate_tokens_per_s_{args.sessions}_sessions": r["aggN"],
        f"batching_gain_{args.sessions}_vs_1": r["aggN"] / r["agg1"],
        "peak_rss_mb_per_peer": rss,
        "gpu_memory_used_total": gpu_mem,
        "generate_tokens_first_32": base["tokens"][:32],
        "two_peers_tokens_first_32": two["tokens"][:32],
    })
    return result


def run_hop(args) -> dict:
    """The tiny-model figures alone: added latency per hop and where it goes, the frame round
    trip, the in-process hot / cold forwards. Nothing to download."""
    import platform
    import tempfile

    from p2pserve.model.tiny import build_tiny_model

    tiny_path = str(build_tiny_model("llama", Path(tempfile.mkdtemp()) / "tiny"))
    tiny = asyncio.run(hop_overhead(tiny_path))

    async def rtts(peer) -> tuple[float, float]:
        p2p = await create_client_p2p()
        try:
            return await frame_rtt_ms(p2p, peer.hop()), await frame_rtt_ms(p2p, peer.hop(), direct=False)
        finally:
            await p2p.close()

    (peer,) = start_peers(tiny_path, [None])
    try:
        rtt, rtt_libp2p = asyncio.run(rtts(peer))
    finally:
        peer.stop()
    cold = cold_forward_ms(tiny_path)
    hot = hot_dispatch_ms(tiny_path)
    return {
        "section": "hop",
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "peer_threads": 1,
        **tiny_figures(tiny, cold, hot),
        "control_frame_rtt_ms": rtt,
        "control_frame_rtt_ms_libp2p_only": rtt_libp2p,
    }


SECTIONS = {"default": run_default, "hop": run_hop, "llama3": run_llama3, "kv": run_kv, "throttle": run_throttle,
            "batching": run_batching}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="JSON file (default: benchmarks/results/runtime[_SECTIONS].json)")
    ap.add_argument("--sections", default=None,
                    help=f"comma-separated, of {', '.join(SECTIONS)} (default: llama3 with --device cuda, else default)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="device of the llama3 section")
    ap.add_argument("--shape", default="llama3-8b", choices=list(LLAMA3_SHAPES), help="llama3 section: model shape")
    ap.add_argument("--model-dir", default=None, help="llama3 section: where the random model is built / reused")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="llama3 section: random prompt length")
    ap.add_argument("--sessions", type=int, default=16, help="llama3 section: concurrent sessions of the aggregate")
    ap.add_argument("--no-one-peer", action="store_true", help="llama3 section: skip the 1-peer chain of every layer")
    ap.add_argument("--kv-prompt", type=int, default=64, help="kv section: prompt tokens before the timed decode")
    ap.add_argument("--kv-system-prompt", type=int, default=256,
                    help="kv section: tokens of a system prompt every session shares (prefix sharing figure)")
    ap.add_argument("--throttle-sessions", type=int, default=12, help="throttle section: sessions of the mixed load")
    ap.add_argument("--throttle-gap", type=float, default=1.5, help="throttle section: mean seconds between arrivals")
    ap.add_argument("--throttle-max-prompt", type=int, default=384, help="throttle section: longest prompt (tokens)")
    ap.add_argument("--throttle-max-reply", type=int, default=24, help="throttle section: longest reply (tokens)")
    ap.add_argument("--throttle-rounds", type=int, default=1, help="throttle section: off/on runs, alternating")
    ap.add_argument("--batching-rounds", type=int, default=2, help="batching section: off/on rounds, alternating")
    ap.add_argument("--batching-depth", type=int, default=3,
                    help="batching section: the micro arm's --pipeline-depth (micro-batches in flight)")
    ap.add_argument("--batching-wait-ms", dest="batch_wait_ms", type=float, default=250.0,
                    help="batching section: the on arm's --batch-wait-ms")
    ap.add_argument("--copy-to", default=None, metavar="DIR", help="also write the JSON into DIR")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sections = (args.sections or ("llama3" if args.device == "cuda" else "default")).split(",")
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    name = "runtime" if sections == ["default"] else "runtime_" + "_".join(
        f"{s}-{args.device}-{args.shape}" if s == "llama3" else s for s in sections)
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"{name}.json"
    result = {}
    for section in sections:
        r = SECTIONS[section](args)
        result.update(r) if len(sections) == 1 else result.update({section: r})
        if len(sections) > 1:  # keep what is done if a later section fails
            write_result(result, out, args.copy_to)
    width = max(map(len, result))
    for k, v in result.items():
        print(f"{k:<{width}}  {v:.3f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    write_result(result, out, args.copy_to)
    print(f"wrote {out}")
    return 0


def write_result(result: dict, out: Path, copy_to: str | None) -> None:
    text = json.dumps(result, indent=2)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    if copy_to:
        Path(copy_to).mkdir(parents=True, exist_ok=True)
        (Path(copy_to) / out.name).write_text(text)


if __name__ == "__main__":
    sys.exit(main())
