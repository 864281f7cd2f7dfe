"""Speculative decoding with prompt lookup against plain decoding, on a copying workload.

Starts 3 local peer processes over a model's layers (a tiny seeded Llama by default, or
``--model default`` for the embedded SmolLM2, or a folder), asks for a code edit of a prompt that
holds the code, greedily, and times the same request both ways in alternating rounds of one run:
plain one-token steps (the baseline) and prompt-lookup drafting (``client/drafts.py``). Prints
tokens/s both ways, their ratio, the draft's acceptance, and whether the tokens are identical, and
writes JSON.

    python benchmarks/speculative.py [--model tiny|default|PATH] [--tokens 96] [--rounds 3]
                                     [--max-k 8] [--fixed-k] [--json benchmarks/results/speculative.json]

``measure(model, hops, prompt_ids, ...)`` is the measurement alone, over any chain of hops (a
benchmark that starts its peers behind a delaying relay calls it with their hops).
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
PROMPT = f"Rename `values` to `xs` in this code and return the whole code:\n\n{CODE}"


async def _one(model, hops, prompt_ids, params, drafter, max_k: int, fixed_k: bool):
    """(tokens, seconds, drafted, accepted) of one generation over a fresh client node."""
    from p2pserve.client.generation import Generation
    from p2pserve.client.speculative import SpeculativeConfig
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
            return gen.result.tokens, seconds, (tuner.drafted if tuner else 0), (tuner.accepted if tuner else 0)
        finally:
            await pipeline.close()


def measure(model, hops, prompt_ids, tokens: int = 96, rounds: int = 3, max_k: int = 8, fixed_k: bool = False) -> dict:
    """Tokens/s of plain decoding and of prompt-lookup speculation over ``hops``, alternating,
    with the median of ``rounds`` each; ``identical`` says whether both gave the same tokens."""
    from p2pserve.client.drafts import PromptLookup
    from p2pserve.client.params import GenerationParams

    params = GenerationParams(max_new_tokens=tokens, ignore_eos=True)
    plain_rates, spec_rates, identical, drafted, accepted = [], [], True, 0, 0
    for _ in range(rounds):
        base, s0, _, _ = asyncio.run(_one(model, hops, prompt_ids, params, None, max_k, fixed_k))
        ours, s1, d, a = asyncio.run(_one(model, hops, prompt_ids, params, PromptLookup(), max_k, fixed_k))
        plain_rates.append(len(base) / s0)
        spec_rates.append(len(ours) / s1)
        identical &= base == ours
        drafted, accepted = drafted + d, accepted + a
    plain, spec = statistics.median(plain_rates), statistics.median(spec_rates)
    return {"plain_tokens_per_s": plain, "speculative_tokens_per_s": spec, "speculative_speedup": spec / plain,
            "identical": identical, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": accepted / drafted if drafted else 0.0, "tokens": tokens, "rounds": rounds,
            "max_k": max_k, "adaptive_k": not fixed_k}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny (a seeded tiny Llama), default (SmolLM2) or a folder")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--fixed-k", action="store_true", help="always draft --max-k tokens (no adaptive k)")
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
            result = measure(model, [p.hop() for p in peers], ids, args.tokens, args.rounds, args.max_k, args.fixed_k)
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
