"""Weight-only quantization of a real-shaped mixture-of-experts layer: memory and quality vs bf16.

    python benchmarks/moe_quantization.py [--family qwen3-moe|mixtral] [--experts 16] [--tokens 64]
                                          [--json benchmarks/results/moe_quantization.json]

One routed-experts block (router + experts) shaped like the real checkpoint's (Qwen3-30B-A3B:
hidden 2048, experts of width 768, 8 per token; Mixtral-8x7B: hidden 4096, width 14336, 2 per
token), built from transformers' own module with seeded weights (std 0.02, about a trained
checkpoint's scale). Only ``--experts`` of the experts are built (Qwen3's 128 would take 1.2 GB in
bf16 for one layer); every expert is real-shaped, so bytes per expert and the error are those of
the real layer, and the layer's bytes are scaled up to the real expert count.

Against the same block in fp32 (the reference), measured in the same run, for bf16 and for each
``--quant`` scheme applied by ``p2pserve.model.quant.quantize_layers`` to the bf16 block (what a
peer serving a bf16 checkpoint with ``--dtype bfloat16 --quant X`` holds): weight bytes of the
experts (``weight_bytes``, packed storage and scales); the experts' relative error
``|y - y_fp32| / |y_fp32|`` over ``--tokens`` random hidden states with the fp32 router's choices
and weights given to every variant (the weights' rounding alone); the whole block's error with
its own routing; and the share of tokens whose top-k expert set equals the fp32 router's (the
router stays unquantized; it differs only through bf16 rounding, and one flipped expert moves a
token's output far, which is why the block error is above the experts' error). Random weights are not a trained model: this measures the quantizers' rounding on
real shapes, not downstream quality.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from p2pserve.model.family_configs import FAMILIES
from p2pserve.model.quant import quantize_layers, weight_bytes

_KEYS = {"qwen3-moe": "num_experts", "mixtral": "num_local_experts"}


def build_block(family: str, experts: int):
    """The family's MoE block at real shapes with ``experts`` experts, seeded, fp32."""
    from transformers import AutoConfig

    raw = dict(FAMILIES[family]["config"], num_hidden_layers=1)
    raw[_KEYS[family]] = experts
    cfg = AutoConfig.for_model(**raw)
    cfg._experts_implementation = "eager"
    layer_cls = {"qwen3-moe": "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
                 "mixtral": "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock"}[family]
    module, name = layer_cls.rsplit(".", 1)
    block = getattr(__import__(module, fromlist=[name]), name)(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    return block.eval(), cfg


def routed(block, h: torch.Tensor) -> torch.Tensor:
    """Top-k expert ids [T, k] the block's router picks, sorted per token."""
    _, _, index = block.gate(h)
    return index.sort(dim=-1).values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="qwen3-moe", choices=sorted(_KEYS))
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--quant", default="int8,int4,nf4")
    ap.add_argument("--json", default="benchmarks/results/moe_quantization.json")
    args = ap.parse_args()
    top_k = FAMILIES[args.family]["config"]["num_experts_per_tok"]
    if args.experts < top_k:
        ap.error(f"--experts must be at least the {top_k} experts a token runs")
    torch.set_num_threads(1)
    real = FAMILIES[args.family]["config"][_KEYS[args.family]]
    ref, cfg = build_block(args.family, args.experts)
    h = torch.randn(args.tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(1))  # [T, H]
    with torch.inference_mode():
        y_ref = ref(h[None])[0]
        _, weights_ref, index_ref = ref.gate(h)
        picks_ref = index_ref.sort(dim=-1).values
    rows = []

    def measure(name: str, block, dtype) -> None:
        t0 = time.perf_counter()
        with torch.inference_mode():
            x = h.to(dtype)
            y = block(x[None])[0].float()
            y_experts = block.experts(x, index_ref, weights_ref.to(dtype)).float()
            picks = routed(block, x)
        elapsed = time.perf_counter() - t0
        experts_bytes = weight_bytes(block.experts)
        rows.append(dict(
            scheme=name,
            expert_bytes_per_expert=experts_bytes / args.experts,
            layer_expert_gib_at_real_count=experts_bytes / args.experts * real / 2**30,
            rel_error=float((y_experts - y_ref).norm() / y_ref.norm()),
            block_rel_error=float((y - y_ref).norm() / y_ref.norm()),
            max_abs_error=float((y - y_ref).abs().max()),
            routing_agreement=float((picks == picks_ref).all(-1).float().mean()),
            seconds=elapsed,
        ))
        print(f"{name:>6}: {rows[-1]['expert_bytes_per_expert'] / 2**20:8.2f} MiB/expert  "
              f"{rows[-1]['layer_expert_gib_at_real_count']:6.2f} GiB/layer ({real} experts)  "
              f"experts rel.err {rows[-1]['rel_error']:.2e}  block {rows[-1]['block_rel_error']:.2e}  routing {rows[-1]['routing_agreement']:.3f}", flush=True)

    measure("fp32", ref, torch.float32)
    bf16 = copy.deepcopy(ref).to(torch.bfloat16)
    measure("bf16", bf16, torch.bfloat16)
    for scheme in [s for s in args.quant.split(",") if s]:
        block = copy.deepcopy(bf16)
        holder = torch.nn.ModuleList([block])
        quantize_layers(holder, scheme)
        measure(scheme, holder[0], torch.bfloat16)
    base = next(r for r in rows if r["scheme"] == "bf16")
    for r in rows:
        r["bytes_vs_bf16"] = r["expert_bytes_per_expert"] / base["expert_bytes_per_expert"]
        r["error_vs_bf16"] = r["rel_error"] / base["rel_error"] if base["rel_error"] else None
    print("\nbytes and error as ratios against bf16 (measured in this run):")
    for r in rows:
        print(f"  {r['scheme']:>6}: bytes {r['bytes_vs_bf16']:.3f}x  error {r['error_vs_bf16'] or 0:.1f}x")
    out = dict(family=args.family, hub=FAMILIES[args.family]["hub"], experts_built=args.experts,
               experts_real=real, hidden=cfg.hidden_size, tokens=args.tokens, rows=rows)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
