"""What structured output costs per token: the client's grammar mask and the last hop's use of it.

For a checkpoint's tokenizer (the embedded SmolLM2 unless ``--model``) and a JSON schema, walks
the tokens of a JSON document valid against it and times, per token: the client's
``fill_next_token_bitmask`` + ``accept_token`` (``client/grammar.py``), and on the last hop
the mask's unpacking and ``masked_fill`` before the choice (``peer/sampling.py``), against the
plain choice from the same logits (the baseline, measured in the same run). Prints the ratios
and the mask's bytes on the wire; writes JSON (``--out``).

    python benchmarks/grammar_mask.py [--model PATH] [--reps 200] [--out grammar_mask.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}}, "required": ["name", "age", "tags", "address"]}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines"], "address": {"city": "London", "zip": "W1"}}


def _median_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default="grammar_mask.json")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # a peer's compute thread; the machine is shared
    from p2pserve.client.grammar import GrammarCompiler
    from p2pserve.client.model_info import LocalModelInfo
    from p2pserve.peer.sampling import sample_token
    from p2pserve.protocol import SamplingParams

    info = LocalModelInfo.load(args.model)
    vocab = info.spec.vocab_size
    t0 = time.perf_counter()
    compiler = GrammarCompiler(info.tokenizer, vocab, info.eos_ids)
    tokenizer_info_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = compiler.json_schema(SCHEMA)
    compile_s = time.perf_counter() - t0
    tokens = info.tokenizer.encode(json.dumps(DOCUMENT, separators=(", ", ": ")), add_special_tokens=False)
    state = grammar.matcher()
    masks, client_us = [], []
    for t in tokens:  # the client's work per token: the mask, then taking the sampled token
        t0 = time.perf_counter()
        masks.append(state.mask())
        state.accept(t)
        client_us.append((time.perf_counter() - t0) * 1e6)
    logits = torch.randn(vocab)
    params = SamplingParams(temperature=0.7, seed=1)
    plain_us = _median_us(lambda: sample_token(logits, params, 5), args.reps)
    masked_us = _median_us(lambda: sample_token(logits, params, 5, allowed=masks[len(masks) // 2]), args.reps)
    greedy_plain_us = _median_us(lambda: sample_token(logits, SamplingParams(), 5), args.reps)
    greedy_masked_us = _median_us(lambda: sample_token(logits, SamplingParams(), 5, allowed=masks[0]), args.reps)
    report = {
        "model": info.path, "vocab": vocab, "tokens": len(tokens), "mask_bytes": len(masks[0]),
        "tokenizer_info_s": round(tokenizer_info_s, 3), "schema_compile_s": round(compile_s, 4),
        "client_mask_us_median": round(statistics.median(client_us), 1),
        "client_mask_us_max": round(max(client_us), 1),
        "peer_sample_us": {"plain": round(plain_us, 1), "masked": round(masked_us, 1),
                           "greedy_plain": round(greedy_plain_us, 1), "greedy_masked": round(greedy_masked_us, 1)},
        "peer_masked_over_plain": round(masked_us / plain_us, 2),
        "peer_greedy_masked_over_plain": round(greedy_masked_us / greedy_plain_us, 2),
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
