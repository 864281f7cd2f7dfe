"""Weight-only quantization on CPU: which library, and what it costs in quality.

    python benchmarks/quantization.py [--sections libraries,quality] [--tokens 32]
                                      [--json benchmarks/results/quantization.json]

Two sections, both on the embedded SmolLM2-135M (30 decoder layers, hidden 576), 1 torch thread,
against the full-width fp32 model measured in the same run:

* ``libraries``: every candidate library that imports here (torchao, bitsandbytes, optimum-quanto,
  HQQ) quantizes the decoder layers' linear projections; per-token decode time (greedy
  ``generate``, prefill excluded) and weight bytes per layer, as ratios against fp32. Candidates
  that do not import or fail on CPU are listed with the reason. This is what chose the library
  of each scheme in ``p2pserve/model/quant.py`` (``docs/quantization.md`` has the table).
* ``quality``: the schemes ``p2pserve peer --quant`` serves (through ``quantize_layers``):
  perplexity on a fixed English text of a few hundred tokens, greedy agreement with fp32 over
  ``--tokens`` tokens on three prompts (the share of positions equal up to the first divergence,
  and the first divergence), per-token time and weight bytes per layer.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Callable

import torch

from p2pserve.model.default import resolve_model
from p2pserve.model.quant import NF4_BLOCK, SCHEMES, quantize_layers, weight_bytes

TEXT = (
    "The river town woke slowly on market days. Before dawn the bakers lit their ovens, and the smell of "
    "bread drifted down the narrow streets to the water, where fishermen were already mending their nets. "
    "By seven the square was full of carts: farmers from the hills brought apples, cheese and wool, and "
    "traders from the coast sold salt, dried fish and bright cloth. Children ran between the stalls while "
    "their parents argued over prices, and an old man played the violin by the fountain for coins. "
    "At noon the church bell rang and everyone stopped to eat. The innkeeper, a tall woman named Clara, "
    "served soup and beer to anyone who could pay, and to a few who could not. She knew every family in the "
    "valley and most of their secrets, but she kept them to herself. In the afternoon the weather turned. "
    "Dark clouds came over the hills, the wind picked up, and the first drops of rain fell on the canvas "
    "roofs. The traders packed quickly, tying down their goods and calling to their horses. By evening the "
    "square was empty again, except for the violinist, who sat under the arch of the old gate and played "
    "a slow tune that nobody stayed to hear. Years later, when the railway came and the market moved to "
    "the city, people in the town still spoke of those days with a mixture of pride and regret. They "
    "remembered the noise and the crowds, the smell of bread and rain, and the feeling that the whole "
    "world passed through their square once a week. The young ones did not understand what had been lost; "
    "the old ones could not explain it. History, the schoolteacher liked to say, is mostly made of "
    "ordinary days that nobody thought to write down."
)
PROMPTS = ["What is the capital of France?", "Write a short poem about the sea.",
           "Explain in two sentences why the sky is blue."]


# ------------------------------------------------------------------------------------ candidates
# Each takes the decoder ModuleList and quantizes its nn.Linear modules in place.

def _swap_linears(layers, make: Callable) -> None:
    for parent in list(layers.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, make(child))


def torchao_int8(layers):
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(layers, Int8WeightOnlyConfig())


def torchao_int4(layers):
    quantize_layers(layers, "int4")  # IntxWeightOnlyConfig(int4, PerGroup(32)): stored unpacked in int8


def torchao_nf4(layers):
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    for m in layers.modules():
        if type(m) is torch.nn.Linear:
            m.weight = torch.nn.Parameter(to_nf4(m.weight.detach(), NF4_BLOCK, 64), requires_grad=False)


def bnb_int8(layers):
    import bitsandbytes as bnb

    def make(lin):
        q = bnb.nn.Linear8bitLt(lin.in_features, lin.out_features, bias=lin.bias is not None, has_fp16_weights=False)
        q.load_state_dict(lin.state_dict())
        return q.to("cpu")

    _swap_linears(layers, make)


def bnb_nf4(layers):
    quantize_layers(layers, "nf4")


def quanto(weights: str):
    def run(layers):
        from optimum import quanto as q

        q.quantize(layers, weights=getattr(q, weights))
        q.freeze(layers)

    return run


def hqq(nbits: int):
    def run(layers):
        from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

        cfg = BaseQuantizeConfig(nbits=nbits, group_size=64)
        _swap_linears(layers, lambda lin: HQQLinear(lin, cfg, compute_dtype=torch.float32, device="cpu"))

    return run


CANDIDATES: dict[str, tuple[str, Callable]] = {
    "torchao int8 (Int8WeightOnlyConfig)": ("int8", torchao_int8),
    "bitsandbytes int8 (Linear8bitLt)": ("int8", bnb_int8),
    "optimum-quanto qint8": ("int8", quanto("qint8")),
    "HQQ 8-bit g64": ("int8", hqq(8)),
    "torchao int4 (IntxWeightOnly, g32)": ("int4", torchao_int4),
    "optimum-quanto qint4": ("int4", quanto("qint4")),
    "HQQ 4-bit g64": ("int4", hqq(4)),
    "bitsandbytes nf4 (Linear4bit)": ("nf4", bnb_nf4),
    "torchao nf4 (NF4Tensor)": ("nf4", torchao_nf4),
}


# ------------------------------------------------------------------------------------ measuring

def load_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def greedy(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def ms_per_token(model, ids: list[int], n: int) -> float:
    """Decode time per token: (n+1 new tokens - 1 new token) / n, the prefill cancelled out; best of
    3 (the development machine is shared: the minimum is the least disturbed run)."""
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        greedy(model, ids, 1)
        t1 = time.perf_counter()
        greedy(model, ids, n + 1)
        t2 = time.perf_counter()
        best = min(best, ((t2 - t1) - (t1 - t0)) / n * 1e3)
    return best


@torch.no_grad()
def perplexity(model, ids: list[int]) -> float:
    x = torch.tensor([ids])
    return math.exp(model(x, labels=x).loss.item())


def agreement(ref: list[int], got: list[int]) -> tuple[float, int]:
    """(share of positions equal, first divergence or len) of two greedy runs."""
    first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
    return sum(a == b for a, b in zip(ref, got)) / len(ref), first


def per_layer_bytes(model) -> int:
    layers = model.model.layers
    return weight_bytes(layers) // len(layers)


def libraries(path: str, prompt: list[int], tokens: int) -> dict:
    base = load_model(path)
    fp32_ms, fp32_bytes = ms_per_token(base, prompt, tokens), per_layer_bytes(base)
    rows = {"fp32": {"scheme": "none", "ms_per_token": fp32_ms, "bytes_per_layer": fp32_bytes}}
    print(f"{'candidate':40s} {'ms/token':>9s} {'x fp32':>7s} {'MB/layer':>9s} {'x fp32':>7s}")
    print(f"{'fp32 (baseline)':40s} {fp32_ms:9.2f} {1:7.2f} {fp32_bytes / 2**20:9.2f} {1:7.2f}")
    for name, (scheme, apply) in CANDIDATES.items():
        model = load_model(path)
        try:
            apply(model.model.layers)
            ms, nbytes = ms_per_token(model, prompt, tokens), per_layer_bytes(model)
        except Exception as e:  # noqa: BLE001 - a candidate that does not run here is a result
            rows[name] = {"scheme": scheme, "error": f"{type(e).__name__}: {str(e)[:160]}"}
            print(f"{name:40s} unavailable: {rows[name]['error']}")
            continue
        rows[name] = {"scheme": scheme, "ms_per_token": ms, "bytes_per_layer": nbytes,
                      "time_vs_fp32": ms / fp32_ms, "memory_vs_fp32": nbytes / fp32_bytes}
        print(f"{name:40s} {ms:9.2f} {ms / fp32_ms:7.2f} {nbytes / 2**20:9.2f} {nbytes / fp32_bytes:7.2f}")
    again = ms_per_token(base, prompt, tokens)  # the machine's drift over the section
    rows["fp32 again"] = {"scheme": "none", "ms_per_token": again, "time_vs_fp32": again / fp32_ms}
    print(f"{'fp32 again (drift check)':40s} {again:9.2f} {again / fp32_ms:7.2f}")
    return rows


def quality(path: str, tokenizer, tokens: int) -> dict:
    text_ids = tokenizer(TEXT)["input_ids"]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True) for p in PROMPTS]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    rows, refs = {}, None
    print(f"\nquality over {len(text_ids)} tokens of fixed text; greedy agreement over {tokens} tokens x {len(prompts)} prompts")
    print(f"{'scheme':8s} {'ppl':>8s} {'x fp32':>7s} {'agree':>6s} {'first div':>10s} {'ms/token':>9s} {'x fp32':>7s} {'MB/layer':>9s}")
    for scheme in ("none", *SCHEMES):
        model = load_model(path)
        try:
            quantize_layers(model.model.layers, None if scheme == "none" else scheme)
        except Exception as e:  # noqa: BLE001 - the extra may be missing
            rows[scheme] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{scheme:8s} unavailable: {rows[scheme]['error']}")
            continue
        outs = [greedy(model, p, tokens) for p in prompts]
        refs = refs or outs
        agree = [agreement(r, o) for r, o in zip(refs, outs)]
        row = {"perplexity": perplexity(model, text_ids), "agreement": sum(a for a, _ in agree) / len(agree),
               "first_divergence": [f for _, f in agree], "ms_per_token": ms_per_token(model, prompts[0], tokens),
               "bytes_per_layer": per_layer_bytes(model)}
        base = rows.get("none", row)
        row.update(ppl_vs_fp32=row["perplexity"] / base["perplexity"], time_vs_fp32=row["ms_per_token"] / base["ms_per_token"],
                   memory_vs_fp32=row["bytes_per_layer"] / base["bytes_per_layer"])
        rows[scheme] = row
        print(f"{scheme:8s} {row['perplexity']:8.3f} {row['ppl_vs_fp32']:7.3f} {row['agreement']:6.2f} "
              f"{str(row['first_divergence']):>10s} {row['ms_per_token']:9.2f} {row['time_vs_fp32']:7.2f} "
              f"{row['bytes_per_layer'] / 2**20:9.2f}")
    return {"text_tokens": len(text_ids), "tokens": tokens, "prompts": PROMPTS, "schemes": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="libraries,quality")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt (and timed decode tokens)")
    ap.add_argument("--json", default="benchmarks/results/quantization.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from transformers import AutoTokenizer

    path = str(resolve_model("default"))
    tok = AutoTokenizer.from_pretrained(path)
    out = {"model": "SmolLM2-135M-Instruct", "device": "cpu", "threads": 1, "torch": torch.__version__}
    sections = args.sections.split(",")
    if "libraries" in sections:
        prompt = tok(PROMPTS[0])["input_ids"]
        out["libraries"] = libraries(path, prompt, args.tokens)
    if "quality" in sections:
        out["quality"] = quality(path, tok, args.tokens)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
