"""One decode step of the shard, eager fast path against the compiled one, fp32 and bf16.

In one process, one shard of every layer, sessions paged over one pool at equal lengths: ms per
step at each batch size (median of ``--steps`` steps after warm-up; wall time and the process's
CPU time, which is steadier on a shared machine), the compile time of the buckets, and exactness:
greedy tokens of one session through the eager path, the compiled path (twice: deterministic?)
and transformers ``generate`` on the same weights.

  python benchmarks/step.py                                 # SmolLM2, batch 1/8/32, fp32 and bf16
  python benchmarks/step.py --batches 1,8 --steps 5 --dtypes bfloat16 --threads 1
  python benchmarks/step.py --ab --dtypes bfloat16 --batches 1,32 --prompt 200   # the CPU bf16 speed-ups, A/B

Writes benchmarks/results/step.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from p2pserve.model.default import resolve_model  # noqa: E402
from p2pserve.model.shard import TORCH_DTYPES, Segment, Shard  # noqa: E402
from p2pserve.model.spec import load_spec  # noqa: E402
from p2pserve.peer.kv_cache import KVBudget, PagedCache  # noqa: E402


def load_shard(path: str, dtype: str, device: str, max_batch: int, max_len: int, packed: bool = True,
               fused: bool = True) -> Shard:
    """A shard of every layer with a pool for ``max_batch`` sessions of ``max_len`` tokens;
    ``packed`` / ``fused`` False keep CPU bf16's projections unpacked (model/packed_linear.py) /
    its decodes on the eager attention (model/decode_attention.py)."""
    spec = load_spec(path, dtype=dtype)
    shard = Shard.load(path, spec, 0, spec.num_layers, device=device)
    shard.pack_weights = packed  # read when the first step builds the layer plans
    pool = KVBudget(spec.num_layers * (max_len + 16) * (max_batch + 1))
    pool.bind(spec.num_kv_heads, spec.head_dim, TORCH_DTYPES[dtype], device=device)
    pool.fused = fused
    shard.bench_pool = pool
    return shard


#: ``--ab``: the eager step with and without each CPU half-precision speed-up, (packed, fused).
AB_VARIANTS = {"packed+fused": (True, True), "packed": (True, False), "fused": (False, True), "neither": (False, False)}


def run_ab(args, path: str, dtype: str) -> dict:
    """Median step times of every `AB_VARIANTS` entry per batch size, alternating variants per round."""
    batches = [int(b) for b in args.batches.split(",")]
    out: dict = {name: {b: [] for b in batches} for name in AB_VARIANTS}
    for _ in range(args.ab_rounds):
        for name, (packed, fused) in AB_VARIANTS.items():
            shard = load_shard(path, dtype, args.device, max(batches), args.prompt + args.steps + 64, packed, fused)
            for b in batches:
                out[name][b].append(time_steps(shard, b, args.prompt, args.steps, args.device))
                print(dtype, name, b, out[name][b][-1], flush=True)
    return {name: {b: {k: round(statistics.median(r[k] for r in runs), 2) for k in ("wall_ms", "cpu_ms")}
                   for b, runs in per.items()} for name, per in out.items()}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_steps(shard: Shard, batch: int, prompt: int, steps: int, device: str) -> dict:
    """Median wall / CPU ms of a decode step of ``batch`` sessions after a ``prompt``-token prefill."""
    L = shard.spec.num_layers
    caches = [PagedCache(shard.bench_pool, 0, L, prompt + steps + 16) for _ in range(batch)]
    for c in caches:
        c.reserve(prompt + steps + 2)
    gen = torch.Generator().manual_seed(0)
    for c in caches:  # prefill one by one (not timed)
        ids = torch.randint(0, shard.spec.vocab_size, (prompt,), generator=gen)
        shard.forward_batch([Segment(ids.to(device), 0, 0, L, c, want_logits=True)])
    wall, cpu = [], []
    for s in range(steps + 2):
        segs = [Segment(torch.tensor([7 + j], device=device), prompt + s, 0, L, c, want_logits=True)
                for j, c in enumerate(caches)]
        sync(device)
        t, p = time.perf_counter(), time.process_time()
        shard.forward_batch(segs)
        sync(device)
        if s >= 2:  # two warm-up steps
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - p)
    for c in caches:
        c.release()
    return {"wall_ms": round(1000 * statistics.median(wall), 2), "cpu_ms": round(1000 * statistics.median(cpu), 2)}


@torch.inference_mode()
def greedy(shard: Shard, ids: list[int], n: int, device: str) -> list[int]:
    """Greedy tokens of one session through ``shard`` (its pool, a fresh cache)."""
    L = shard.spec.num_layers
    cache = PagedCache(shard.bench_pool, 0, L, len(ids) + n + 16)
    cache.reserve(len(ids) + n)
    out, x, pos = [], torch.tensor(ids, device=device), 0
    try:
        for _ in range(n):
            logits = shard.forward_batch([Segment(x, pos, 0, L, cache, want_logits=True)])[0]
            pos += x.shape[0]
            out.append(int(logits.argmax()))
            x = torch.tensor([out[-1]], device=device)
    finally:
        cache.release()
    return out


@torch.inference_mode()
def generate_tokens(path: str, ids: list[int], n: int, dtype: str, device: str) -> list[int]:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=TORCH_DTYPES[dtype]).to(device).eval()
    m.generation_config.eos_token_id = None
    x = torch.tensor([ids], device=device)
    out = m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def run_dtype(args, path: str, dtype: str) -> dict:
    batches = [int(b) for b in args.batches.split(",")]
    shard = load_shard(path, dtype, args.device, max(batches), args.prompt + args.steps + args.tokens + 64)
    ids = list(range(100, 100 + args.prompt_ids))
    res: dict = {"eager": {}, "compiled": {}}
    for b in batches:
        res["eager"][b] = time_steps(shard, b, args.prompt, args.steps, args.device)
        print(dtype, "eager", b, res["eager"][b], flush=True)
    res["eager_tokens"] = greedy(shard, ids, args.tokens, args.device)
    t = time.perf_counter()
    shard.enable_compile(tuple(batches) if args.buckets is None else tuple(int(x) for x in args.buckets.split(",")))
    res["compile_s"] = round(time.perf_counter() - t, 1)
    print(dtype, "compiled the buckets in", res["compile_s"], "s", flush=True)
    for b in batches:
        res["compiled"][b] = time_steps(shard, b, args.prompt, args.steps, args.device)
        print(dtype, "compiled", b, res["compiled"][b], flush=True)
    res["compiled_tokens"] = greedy(shard, ids, args.tokens, args.device)
    res["compiled_deterministic"] = greedy(shard, ids, args.tokens, args.device) == res["compiled_tokens"]
    res["generate_tokens"] = generate_tokens(path, ids, args.tokens, dtype, args.device)
    res["eager_equals_generate"] = res["eager_tokens"] == res["generate_tokens"]
    res["compiled_equals_generate"] = res["compiled_tokens"] == res["generate_tokens"]
    res["compiled_over_eager_wall"] = {b: round(res["eager"][b]["wall_ms"] / res["compiled"][b]["wall_ms"], 3)
                                       for b in batches}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--buckets", default=None, help="compiled batch buckets (default: the batch sizes)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompt", type=int, default=128, help="cached tokens before the timed steps")
    ap.add_argument("--prompt-ids", type=int, default=16, help="exactness check: prompt length")
    ap.add_argument("--tokens", type=int, default=16, help="exactness check: greedy tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ab", action="store_true",
                    help="only the eager step, with and without packed projections and the compiled decode attention")
    ap.add_argument("--ab-rounds", type=int, default=2, help="--ab: rounds over the variants, alternating")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "step.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = str(resolve_model(args.model))
    import os

    if args.ab:
        result = {"model": path, "device": args.device, "threads": args.threads, "load_average": os.getloadavg(),
                  "ab": {d: run_ab(args, path, d) for d in args.dtypes.split(",")}}
        for d, per in result["ab"].items():
            base = per["neither"]
            for name, times in per.items():
                print(f"{d} {name}: " + ", ".join(f"batch {b} {t['cpu_ms']} ms CPU (x{base[b]['cpu_ms'] / t['cpu_ms']:.2f} "
                                                   f"faster than neither)" for b, t in times.items()))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print("wrote", args.out)
        return 0
    result = {"model": path, "device": args.device, "threads": args.threads, "load_average": os.getloadavg(),
              "dtypes": {d: run_dtype(args, path, d) for d in args.dtypes.split(",")}}
    for d, r in result["dtypes"].items():
        print(f"{d}: compiled / eager speed-up (wall) {r['compiled_over_eager_wall']}, compile {r['compile_s']} s, "
              f"greedy == generate: eager {r['eager_equals_generate']}, compiled {r['compiled_equals_generate']}, "
              f"compiled deterministic {r['compiled_deterministic']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
