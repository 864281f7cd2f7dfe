"""CPU bf16 projections packed for oneDNN at load: the plan holds packed weights where this CPU
runs them natively, and a step agrees with the unpacked one."""

from __future__ import annotations

import pytest
import torch

from p2pserve.model.packed_linear import packing_available
from p2pserve.model.shard import Segment, Shard
from p2pserve.model.spec import load_spec
from p2pserve.peer.kv_cache import SequenceCache


def _logits(path: str, pack: bool) -> tuple[Shard, torch.Tensor]:
    spec = load_spec(path, dtype="bfloat16")
    shard = Shard.load(path, spec, 0, spec.num_layers)
    shard.pack_weights = pack
    cache = SequenceCache(0, spec.num_layers, spec.num_kv_heads, spec.head_dim, 32, torch.bfloat16)
    ids = torch.arange(3, 11)
    return shard, shard.forward_batch([Segment(ids, 0, 0, spec.num_layers, cache, want_logits=True)])[0]


@pytest.mark.skipif(not packing_available(), reason="this CPU has no native bf16 arithmetic for oneDNN")
def test_bf16_projections_are_packed_and_agree_with_unpacked(model_dir):
    path = model_dir("llama")
    packed, got = _logits(path, True)
    plain, want = _logits(path, False)
    assert packed._plan is not None and packed._plan[0].o[0].is_mkldnn and packed._head[1].is_mkldnn
    assert not plain._plan[0].o[0].is_mkldnn
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # bf16 rounding of two GEMM kernels
