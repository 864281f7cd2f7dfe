"""Speculative decoding with prompt lookup against plain decoding, on a copying workload.

Starts 3 local peer processes over a model's layers (a tiny seeded Llama by default, or
``--model default`` for the embedded SmolLM2, or a folder) and times the same greedy request
both ways in alternating rounds of one run: plain one-token steps (the baseline) and prompt-lookup
drafting (``client/drafts.py``). Prints tokens/s both ways, their ratio, the draft's acceptance,
and whether the tokens are identical, and writes JSON.

The request: by default the first prompt of ``PROMPTS`` (a code edit returning the code), run to
``--tokens`` whatever the model says; with ``--all-prompts`` every prompt of ``PROMPTS`` (two code
edits, a spelling fix returning the paragraph, a summary quoting its text), each reply ending at
its end-of-turn token, and the ratio of total tokens over total seconds. Past its end of turn a
small model starts a new, invented conversation, which is no copying workload.

    python benchmarks/speculative.py [--model tiny|default|PATH] [--tokens 96] [--rounds 3]
                                     [--max-k 8] [--fixed-k] [--all-prompts]
                                     [--json benchmarks/results/speculative.json]

``measure(model, hops, prompt_ids, ...)`` and ``measure_prompts(model, hops, ...)`` are the
measurement alone, over any chain of hops (``benchmarks/wan.py`` calls ``measure_prompts`` with
hops behind delaying relays).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

CODE = '''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total += (v - m) ** 2
    return total / len(values)
'''
WORDS = '''def count_words(text):
    counts = {}
    for word in text.split():
        word = word.lower()
        counts[word] = counts.get(word, 0) + 1
    return counts
'''
RIVER = ("The river rises in the northern hills and flows south for two hundred miles. "
         "Farmers along its banks grow wheat and barley, and the town of Millford was built "
         "where the river meets the old trade road. In spring the water runs high and fast.")
PROMPT = f"Rename `values` to `xs` in this code and return the whole code:\n\n{CODE}"
#: the copying workload, fixed before any WAN figure was taken: two code edits, a prose edit and
#: a summary that quotes; each reply ends at its end-of-turn token (what follows it is no copy)
PROMPTS = {
    "code-rename-two-functions": PROMPT,
    "code-rename-one-function": f"Rewrite this function with the variable `counts` renamed to `freq`:\n\n"
                                f"```python\n{WORDS}```",
    "prose-fix-spelling": "Fix the spelling mistakes in this paragraph and return the corrected paragraph:\n\n"
                          + RIVER.replace("flows", "flwos").replace("barley", "barly"),
    "summary-quoting": "Summarise this text, quoting its first sentence:\n\n" + RIVER,
}


async def _one(model, hops, prompt_ids, params, drafter, max_k: int, fixed_k: bool):
    """(tokens, seconds, drafted, accepted, fit) of one generation over a fresh client node; ``fit``:
    the tuner's last (t0, t_tok) in seconds, None without a drafter."""
    from p2pserve.client.generation import Generation
    from p2pserve.config import SpeculativeConfig
    from tests.harness import client_node, open_chain_pipeline

    async with client_node() as transport:
        pipeline = await open_chain_pipeline(transport, hops, model, len(prompt_ids) + params.max_new_tokens, params)
        try:
            gen = Generation(pipeline, prompt_ids, params, model.eos_ids, drafter=drafter,
                             speculative=SpeculativeConfig(max_k=max_k, adaptive=not fixed_k))
            t0 = time.perf_counter()
            async for _ in gen:
                pass
            seconds = time.perf_counter() - t0
            tuner = gen.tuner
            return (gen.result.tokens, seconds, (tuner.drafted if tuner else 0), (tuner.accepted if tuner else 0),
                    tuner.step_time() if tuner else None)
        finally:
            await pipeline.close()


def measure(model, hops, prompt_ids, tokens: int = 96, rounds: int = 3, max_k: int = 8, fixed_k: bool = False,
            stop_at_eos: bool = False) -> dict:
    """Tokens/s of plain decoding and of prompt-lookup speculation over ``hops``, alternating,
    with the median of ``rounds`` each; ``identical`` says whether both gave the same tokens.
    ``stop_at_eos``: a reply ends at its end-of-turn token (else it runs to ``tokens``)."""
    from p2pserve.client.drafts import PromptLookup
    from p2pserve.client.params import GenerationParams

    params = GenerationParams(max_new_tokens=tokens, ignore_eos=not stop_at_eos)
    plain_rates, spec_rates, identical, drafted, accepted = [], [], True, 0, 0
    plain_s = spec_s = 0.0
    fits = []
    for _ in range(rounds):
        base, s0, _, _, _ = asyncio.run(_one(model, hops, prompt_ids, params, None, max_k, fixed_k))
        ours, s1, d, a, fit = asyncio.run(_one(model, hops, prompt_ids, params, PromptLookup(), max_k, fixed_k))
        fits.append(fit)
        plain_rates.append(len(base) / s0)
        spec_rates.append(len(ours) / s1)
        plain_s, spec_s = plain_s + s0, spec_s + s1
        identical &= base == ours
        drafted, accepted = drafted + d, accepted + a
    plain, spec = statistics.median(plain_rates), statistics.median(spec_rates)
    return {"plain_tokens_per_s": plain, "speculative_tokens_per_s": spec, "speculative_speedup": spec / plain,
            "identical": identical, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": accepted / drafted if drafted else 0.0, "tokens": len(base), "rounds": rounds,
            "max_k": max_k, "adaptive_k": not fixed_k, "plain_seconds": plain_s, "speculative_seconds": spec_s,
            # the tuner's fit of a step's time t(k) = t0 + k * t_tok at the end of each speculative round
            "fitted_t0_s": [f[0] for f in fits], "fitted_t_tok_s": [f[1] for f in fits]}


def measure_prompts(model, hops, tokens: int = 96, rounds: int = 2, max_k: int = 8, fixed_k: bool = False) -> dict:
    """:func:`measure` on every prompt of :data:`PROMPTS` (replies end at end of turn), and the
    whole workload's figures: ``speculative_speedup`` is the total tokens over the total seconds
    of the speculative rounds against the plain rounds', ``identical`` holds for every prompt."""
    per = {}
    for name, text in PROMPTS.items():
        ids = model.chat_ids([{"role": "user", "content": text}])
        per[name] = measure(model, hops, ids, tokens, rounds, max_k, fixed_k, stop_at_eos=True)
        per[name]["prompt_tokens"] = len(ids)
    total = sum(r["tokens"] for r in per.values()) * rounds
    plain = total / sum(r["plain_seconds"] for r in per.values())
    spec = total / sum(r["speculative_seconds"] for r in per.values())
    drafted = sum(r["draft_tokens"] for r in per.values())
    accepted = sum(r["accepted_tokens"] for r in per.values())
    return {"plain_tokens_per_s": plain, "speculative_tokens_per_s": spec, "speculative_speedup": spec / plain,
            "identical": all(r["identical"] for r in per.values()), "draft_tokens": drafted,
            "accepted_tokens": accepted, "acceptance": accepted / drafted if drafted else 0.0,
            "rounds": rounds, "max_k": max_k, "adaptive_k": not fixed_k, "prompts": per}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny (a seeded tiny Llama), default (SmolLM2) or a folder")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--fixed-k", action="store_true", help="always draft --max-k tokens (no adaptive k)")
    ap.add_argument("--all-prompts", action="store_true",
                    help="every prompt of PROMPTS, each reply ending at its end of turn (else the first, --tokens long)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from p2pserve.client.model_info import LocalModelInfo
    from p2pserve.launch import start_peers
    from p2pserve.model.default import default_model_path
    from p2pserve.model.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            path = str(build_tiny_model("llama", Path(tmp) / "tiny", seed=0))
        else:
            path = str(default_model_path()) if args.model == "default" else args.model
        model = LocalModelInfo.load(path)
        n = model.spec.num_layers
        cuts = [0, n // 3, 2 * n // 3, n]
        peers = start_peers(path, [(cuts[i], cuts[i + 1]) for i in range(3)])
        try:
            ids = model.chat_ids([{"role": "user", "content": PROMPT}])
            hops = [p.hop() for p in peers]
            result = (measure_prompts(model, hops, args.tokens, args.rounds, args.max_k, args.fixed_k) if args.all_prompts
                      else measure(model, hops, ids, args.tokens, args.rounds, args.max_k, args.fixed_k))
        finally:
            for p in peers:
                p.stop()
    result.update(model=args.model, peers=3, prompt_tokens=len(ids))
    print(f"plain {result['plain_tokens_per_s']:.1f} tok/s, prompt lookup {result['speculative_tokens_per_s']:.1f} "
          f"tok/s: {result['speculative_speedup']:.2f}x (acceptance {result['acceptance']:.2f}, "
          f"identical: {str(result['identical']).lower()})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
