"""One shard over two overlapping or adjacent shards of a model, sharing their weights.

A peer swapping ranges with another holds its old shard (serving) and its new one (loaded) at
once. Where the two ranges overlap or touch, it can serve their union for a while: the joined
shard is built from the same modules, so it costs no load and no second copy of any weight
(``peer/handover.py``: a bridge).
"""

from __future__ import annotations

from p2pserve.model.shard import Shard


def joined(a: Shard, b: Shard) -> Shard:
    """A shard serving ``[min(starts), max(ends))`` from ``a``'s and ``b``'s modules (``a``'s
    where both hold a layer); the ranges must overlap or touch."""
    if a.spec is not b.spec and a.spec != b.spec:
        raise ValueError("cannot join shards of different models")
    if max(a.start, b.start) > min(a.end, b.end):
        raise ValueError(f"[{a.start}, {a.end}) and [{b.start}, {b.end}) leave a gap: no one shard covers both")
    start, end = min(a.start, b.start), max(a.end, b.end)
    shard = Shard(a.spec, a.hf_config, start, end)  # modules on the meta device, replaced below
    for i in range(start, end):
        src = a if a.start <= i < a.end else b
        shard.layers[i - start] = src.layers[i - src.start]
    first = a if a.start == start else b
    shard.embed_tokens = first.embed_tokens
    last = a if a.end == end else b
    shard.norm, shard.lm_head = last.norm, last.lm_head
    shard.rotary = first.rotary
    shard.device = first.device
    shard.pack_weights = a.pack_weights and b.pack_weights
    return shard.eval()
