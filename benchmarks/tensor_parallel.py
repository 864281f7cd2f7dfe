"""Tensor-parallel shard on CPU: decode and prefill step time of a TP-N group against the unsplit shard.

Both run in this process with ``--threads`` torch threads each (the TP group's other ranks are real
child processes, ``p2pserve.peer.tp_rank``, over gloo on loopback), on a seeded fp32 Llama built
here (``--hidden``, ``--layers``, 8 heads, 4 KV heads, MLP 4x hidden). A decode step is ``--batch``
sessions of one token each after ``--context`` cached tokens; a prefill step is one session of
``--prefill`` tokens. Figures are the median over ``--steps`` steps, and the ratios are TP time over
unsplit time measured in the same run (below 1: the group is faster). The greedy token of every
decode step is compared too, and the largest logit difference printed.

On a machine with fewer free cores than ranks the ranks share cores, so the ratio says little
about tensor parallelism itself; record the load average with it.

Usage: python benchmarks/tensor_parallel.py [--tp 2] [--hidden 512] [--layers 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from p2pserve.model.shard import Segment, Shard  # noqa: E402
from p2pserve.model.spec import load_spec  # noqa: E402
from p2pserve.model.tiny import build_tiny_model  # noqa: E402
from p2pserve.peer.kv_cache import SequenceCache  # noqa: E402
from p2pserve.peer.tp_group import TPGroup  # noqa: E402
from p2pserve.config import TPConfig  # noqa: E402


def _timed(shard, spec, kv_heads: int, args) -> dict:
    """Median decode and prefill step seconds of ``shard``, and the decode logits of each step."""
    L = spec.num_layers
    gen = torch.Generator().manual_seed(0)
    caches = [SequenceCache(0, L, kv_heads, spec.head_dim, args.context + args.steps + 8, torch.float32)
              for _ in range(args.batch)]
    prompts = [torch.randint(3, spec.vocab_size, (args.context,), generator=gen) for _ in caches]
    out = shard.forward_batch([Segment(p, 0, 0, L, c, want_logits=True) for p, c in zip(prompts, caches)])
    decode, logits = [], []
    for step in range(args.steps):
        nxt = [o.argmax().reshape(1) for o in out]
        t = time.perf_counter()
        out = shard.forward_batch([Segment(x, args.context + step, 0, L, c, want_logits=True)
                                   for x, c in zip(nxt, caches)])
        decode.append(time.perf_counter() - t)
        logits.append(torch.stack(out))
    prefill = []
    for _ in range(max(3, args.steps // 4)):
        cache = SequenceCache(0, L, kv_heads, spec.head_dim, args.prefill, torch.float32)
        ids = torch.randint(3, spec.vocab_size, (args.prefill,), generator=gen)
        t = time.perf_counter()
        shard.forward_batch([Segment(ids, 0, 0, L, cache, want_logits=True)])
        prefill.append(time.perf_counter() - t)
    return {"decode_s": statistics.median(decode), "prefill_s": statistics.median(prefill), "logits": logits}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--prefill", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_model("llama", Path(tmp) / "m", seed=0, num_layers=args.layers, hidden_size=args.hidden,
                                    intermediate_size=4 * args.hidden, num_attention_heads=8, num_key_value_heads=4))
        spec = load_spec(path)
        base = _timed(Shard.load(path, spec, 0, spec.num_layers), spec, spec.num_kv_heads, args)
        group = TPGroup.start(TPConfig(devices=("cpu",) * args.tp, num_threads=args.threads), path, spec)
        try:
            tp = _timed(group.load(path, spec, 0, spec.num_layers), spec, spec.num_kv_heads // args.tp, args)
        finally:
            group.stop()
    same = all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(base["logits"], tp["logits"]))
    diff = max(float((a - b).abs().max()) for a, b in zip(base["logits"], tp["logits"]))
    report = {
        "config": vars(args), "load_average": os.getloadavg(),
        "unsplit": {k: base[k] for k in ("decode_s", "prefill_s")},
        "tp": {k: tp[k] for k in ("decode_s", "prefill_s")},
        "ratios": {"decode_tp_over_unsplit": tp["decode_s"] / base["decode_s"],
                   "prefill_tp_over_unsplit": tp["prefill_s"] / base["prefill_s"]},
        "greedy_identical": same, "max_abs_logit_diff": diff,
    }
    r = report["ratios"]
    print(f"TP-{args.tp} vs unsplit, hidden {args.hidden}, {args.layers} layers, {args.threads} thread(s) a rank "
          f"(load average {report['load_average'][0]:.2f})")
    print(f"  decode  batch {args.batch}: {base['decode_s'] * 1e3:.2f} ms -> {tp['decode_s'] * 1e3:.2f} ms "
          f"({r['decode_tp_over_unsplit']:.2f}x the time)")
    print(f"  prefill {args.prefill} tokens: {base['prefill_s'] * 1e3:.2f} ms -> {tp['prefill_s'] * 1e3:.2f} ms "
          f"({r['prefill_tp_over_unsplit']:.2f}x the time)")
    print(f"  greedy tokens identical: {same}; largest logit difference {diff:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
