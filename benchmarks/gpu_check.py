"""The engine on one CUDA GPU, in process: speed against the weight reads, batching, exactness.

Run by ``scripts/gpu_check.sh`` (which installs what is missing from a carried wheelhouse). On a
random Llama-3-8B-shaped bf16 model (seeded, built on the GPU; nothing is downloaded), one
shard of every layer over a paged KV pool, as a peer holding the whole model runs it:

* ``batch1_ms_per_token``: median decode step of one session, against ``weight_read_ms``, the
  time to read the step's weights (every layer and the LM head) once at the copy bandwidth
  measured on this GPU;
* ``streams32_over_1``: tokens/s of 32 sessions decoding together over one session's;
* ``greedy``: greedy tokens of one session against transformers ``generate`` with a static cache on
  the same weights (the index of the first difference, None when all agree). In bf16 two correct
  paths may split at a near tie; fp32 is the exactness oracle, checked on a 2-layer model of the
  same width (``fp32_identical``, must be True);
* ``compiled``: the same with the compiled layer parts (model/compiled_step.py): ms per token at
  1 and 32 sessions, its greedy tokens against generate's, and whether two runs of the compiled
  path give the same tokens (``deterministic``) and, in fp32, whether they equal generate's.

``--dry-run`` does all of it on the CPU with a tiny model of the same family (2 layers, hidden
256) and torch.compile's ``eager`` backend (traces the graphs, generates no code), in about a
minute. Writes ``--out`` (default benchmarks/results/gpu_check.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from p2pserve.model.shard import Segment, Shard  # noqa: E402
from p2pserve.model.spec import load_spec  # noqa: E402
from p2pserve.peer.kv_cache import KVBudget, PagedCache  # noqa: E402

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2),
}
COMMON = dict(vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
              rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False,
              bos_token_id=128000, eos_token_id=128001, hidden_act="silu")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build(shape: dict, dtype: torch.dtype, device: str, folder: Path, seed: int = 0):
    """A seeded random Llama-3 model on ``device`` and a shard of all its layers sharing its tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **COMMON, **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    folder.mkdir(parents=True, exist_ok=True)
    config.dtype = dtype
    config.save_pretrained(folder)  # config.json only: the shard's spec and layer classes
    spec = load_spec(folder, dtype=str(dtype).removeprefix("torch."))
    shard = Shard(spec, config, 0, spec.num_layers)
    state = {}
    for name, t in model.state_dict().items():
        if name.startswith("model.layers."):
            state["layers." + name[len("model.layers."):]] = t
        elif name in ("model.embed_tokens.weight", "model.norm.weight"):
            state[name[len("model."):]] = t
        elif name == "lm_head.weight":
            state[name] = t
    shard.load_state_dict(state, strict=False, assign=True)
    shard.rotary.to(device=device, dtype=torch.float32)
    shard.device = torch.device(device)
    shard.eval()
    pool = KVBudget(spec.num_layers * 40 * 256)  # 40 sessions of 256 tokens
    pool.bind(spec.num_kv_heads, spec.head_dim, dtype, device=device)
    shard.check_pool = pool
    return model, shard


def weight_read_ms(shard: Shard, device: str) -> tuple[float, float]:
    """(ms to read one decode step's weights, measured copy GB/s)."""
    step_bytes = sum(p.numel() * p.element_size() for p in shard.layers.parameters())
    step_bytes += shard.lm_head.weight.numel() * shard.lm_head.weight.element_size()
    buf = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(buf)
    dst.copy_(buf)
    sync(device)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        dst.copy_(buf)
        sync(device)
        times.append(time.perf_counter() - t)
    gbps = 2 * buf.numel() / min(times) / 1e9  # a copy reads and writes every byte
    return 1000 * step_bytes / (gbps * 1e9), gbps


@torch.inference_mode()
def decode_ms(shard: Shard, batch: int, device: str, prompt: int = 64, steps: int = 16) -> float:
    """Median ms of a decode step of ``batch`` sessions after a ``prompt``-token prefill each."""
    L = shard.spec.num_layers
    caches = [PagedCache(shard.check_pool, 0, L, 256) for _ in range(batch)]
    for c in caches:
        c.reserve(prompt + steps + 4)
    gen = torch.Generator().manual_seed(1)
    for c in caches:
        ids = torch.randint(0, shard.spec.vocab_size, (prompt,), generator=gen).to(device)
        shard.forward_batch([Segment(ids, 0, 0, L, c, want_logits=True)])
    times = []
    for s in range(steps + 3):
        segs = [Segment(torch.tensor([11 + j], device=device), prompt + s, 0, L, c, want_logits=True)
                for j, c in enumerate(caches)]
        sync(device)
        t = time.perf_counter()
        shard.forward_batch(segs)
        sync(device)
        if s >= 3:
            times.append(time.perf_counter() - t)
    for c in caches:
        c.release()
    return 1000 * statistics.median(times)


@torch.inference_mode()
def greedy(shard: Shard, ids: list[int], n: int, device: str) -> list[int]:
    L = shard.spec.num_layers
    cache = PagedCache(shard.check_pool, 0, L, 256)
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
def generate_static(model, ids: list[int], n: int, device: str) -> list[int]:
    """transformers ``generate``, greedy, with a static KV cache, no EOS stop."""
    model.generation_config.eos_token_id = None
    x = torch.tensor([ids], device=device)
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         pad_token_id=0, cache_implementation="static")
    return out[0, len(ids):].tolist()


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def check(shape: dict, dtype: torch.dtype, args, folder: Path, speed: bool) -> dict:
    device = args.device
    t = time.perf_counter()
    model, shard = build(shape, dtype, device, folder)
    res: dict = {"dtype": str(dtype), "build_s": round(time.perf_counter() - t, 1), "layers": shard.spec.num_layers}
    ids = torch.randint(0, shard.spec.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(2)).tolist()
    if speed:
        res["weight_read_ms"], res["copy_gb_s"] = (round(x, 3) for x in weight_read_ms(shard, device))
        one, many = decode_ms(shard, 1, device), decode_ms(shard, args.streams, device)
        res["batch1_ms_per_token"] = round(one, 3)
        res["batch1_over_weight_read"] = round(one / res["weight_read_ms"], 2)
        res[f"streams{args.streams}_step_ms"] = round(many, 3)
        res[f"streams{args.streams}_over_1"] = round(args.streams * one / many, 2)
    eager = greedy(shard, ids, args.tokens, device)
    reference = generate_static(model, ids, args.tokens, device)
    res["greedy_first_difference_vs_generate"] = first_difference(eager, reference)
    res["greedy_identical"] = eager == reference
    t = time.perf_counter()
    shard.enable_compile((1, args.streams) if speed else (1,), backend=args.compile_backend)
    compiled: dict = {"compile_s": round(time.perf_counter() - t, 1), "backend": args.compile_backend}
    if speed:
        compiled["batch1_ms_per_token"] = round(decode_ms(shard, 1, device), 3)
        compiled[f"streams{args.streams}_step_ms"] = round(decode_ms(shard, args.streams, device), 3)
    tokens = greedy(shard, ids, args.tokens, device)
    compiled["deterministic"] = greedy(shard, ids, args.tokens, device) == tokens
    compiled["first_difference_vs_generate"] = first_difference(tokens, reference)
    compiled["first_difference_vs_eager"] = first_difference(tokens, eager)
    compiled["identical_to_generate"] = tokens == reference
    res["compiled"] = compiled
    del model, shard
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model, torch.compile's eager backend")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens compared")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu_check.json"))
    args = ap.parse_args()
    args.device = "cpu" if args.dry_run else "cuda"
    args.compile_backend = "eager" if args.dry_run else "inductor"
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run", file=sys.stderr)
        return 2
    if args.dry_run:
        torch.set_num_threads(1)
    shape = SHAPES["tiny" if args.dry_run else "llama3-8b"]
    two_layers = dict(shape, num_hidden_layers=2)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = {
            "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (dry run)",
            "torch": torch.__version__, "dry_run": args.dry_run,
            "bf16": check(shape, torch.bfloat16, args, Path(tmp) / "bf16", speed=True),
            "fp32_two_layers": check(two_layers, torch.float32, args, Path(tmp) / "fp32", speed=False),
        }
    result["fp32_identical"] = result["fp32_two_layers"]["greedy_identical"]
    result["fp32_compiled_identical"] = result["fp32_two_layers"]["compiled"]["identical_to_generate"]
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
