"""A joined shard (a peer's bridge during a swap) serves both ranges with the same bits."""

from __future__ import annotations

import pytest
import torch

from p2pserve.model.joined_shard import joined
from p2pserve.model.shard import Segment, Shard
from p2pserve.model.spec import load_spec
from p2pserve.peer.kv_cache import SequenceCache


def _run(shard: Shard, tokens: torch.Tensor) -> list[torch.Tensor]:
    """A 12-token prefill and 3 single-token steps over the whole model: last logits each."""
    spec = shard.spec
    cache = SequenceCache(0, spec.num_layers, spec.num_kv_heads, spec.head_dim, 64, torch.float32)
    out, pos = [], 0
    for chunk in (tokens[:12], tokens[12:13], tokens[13:14], tokens[14:15]):
        out.append(shard.forward_batch([Segment(chunk, pos, 0, spec.num_layers, cache, want_logits=True)])[0])
        pos += chunk.numel()
    return out


@pytest.mark.parametrize("ranges", [((0, 5), (3, 8)), ((4, 8), (0, 4))])
def test_a_joined_shard_equals_the_shard_loaded_whole(model_dir, ranges):
    path = model_dir("llama")
    spec = load_spec(path)
    (a0, a1), (b0, b1) = ranges
    a, b = Shard.load(path, spec, a0, a1), Shard.load(path, spec, b0, b1)
    both = joined(a, b)
    assert (both.start, both.end) == (0, spec.num_layers)
    assert all(p.data_ptr() in {q.data_ptr() for q in [*a.parameters(), *b.parameters()]} for p in both.parameters())
    tokens = torch.randint(0, spec.vocab_size, (15,), generator=torch.Generator().manual_seed(3))
    whole = Shard.load(path, spec, 0, spec.num_layers)
    for got, want in zip(_run(both, tokens), _run(whole, tokens)):
        assert torch.equal(got, want)


def test_ranges_with_a_gap_cannot_be_joined(model_dir):
    path = model_dir("llama")
    spec = load_spec(path)
    with pytest.raises(ValueError, match="gap"):
        joined(Shard.load(path, spec, 0, 2), Shard.load(path, spec, 3, 8))
