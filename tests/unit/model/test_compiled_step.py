"""The compiled layer parts (model/compiled_step.py) run the fast path's math per batch bucket.

torch.compile's ``eager`` backend traces the same graphs inductor would compile but runs them
op by op, so these tests check the tracing, the bucket padding and the attention in between
without minutes of code generation; inductor's own rounding is measured by benchmarks/step.py
and scripts/gpu_check.sh.
"""

from __future__ import annotations

import torch

from p2pserve.model.shard import Segment, Shard
from p2pserve.model.spec import load_spec
from p2pserve.peer.kv_cache import SequenceCache


def _shards(path: str):
    spec = load_spec(path)
    fast, compiled = Shard.load(path, spec, 0, spec.num_layers), Shard.load(path, spec, 0, spec.num_layers)
    assert compiled.enable_compile((1, 4), warm=False, backend="eager")
    return spec, fast, compiled


def _decode(spec, shard: Shard, prompts: list[torch.Tensor], steps: int) -> list[list[int]]:
    """Prefill each prompt alone, then decode every session together, greedy."""
    caches = [SequenceCache(0, spec.num_layers, spec.num_kv_heads, spec.head_dim, 64, torch.float32) for _ in prompts]
    tokens = []
    for p, c in zip(prompts, caches):
        tokens.append([int(shard.forward_batch([Segment(p, 0, 0, spec.num_layers, c, want_logits=True)])[0].argmax())])
    for s in range(steps):
        segs = [Segment(torch.tensor([t[-1]]), len(p) + s, 0, spec.num_layers, c, want_logits=True)
                for p, t, c in zip(prompts, tokens, caches)]
        for t, logits in zip(tokens, shard.forward_batch(segs)):
            t.append(int(logits.argmax()))
    return tokens


def test_lone_session_is_bit_identical_and_batches_pad_to_buckets(model_dir):
    spec, fast, compiled = _shards(model_dir("llama"))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=gen) for n in (5, 9, 7)]
    # One session: bucket 1, no padding, the same ops as the fast path: the same tokens.
    assert _decode(spec, compiled, prompts[:1], 6) == _decode(spec, fast, prompts[:1], 6)
    # Three sessions pad to the bucket of 4 (prefills of 5-9 tokens run eager: above every bucket).
    assert _decode(spec, compiled, prompts, 6) == _decode(spec, fast, prompts, 6)
