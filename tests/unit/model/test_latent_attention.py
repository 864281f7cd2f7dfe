"""Multi-head latent attention (DeepSeek-V3) in one process: the paged pool holds the compressed
latent and the shared rotary key, not K and V; the memory a peer accounts for is that smaller
row; a batched step and a chunked prefill over the pool give each session its lone tokens.

Greedy tokens of a whole-model shard against `generate` (and with a chunked prefill) are in
tests/unit/model/test_family_checkpoints.py; the routed experts in test_moe_families.py; the peers
in tests/integration/test_moe_families.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from p2pserve.errors import UnsupportedModelError
from p2pserve.model.family_configs import DEEPSEEK_V3
from p2pserve.model.shard import Segment, Shard
from p2pserve.model.spec import load_spec
from p2pserve.model.tiny_families import build_family_model
from p2pserve.peer.kv_cache import KVBudget, PagedCache


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    path = str(build_family_model("deepseek-v3", tmp_path_factory.mktemp("mla") / "deepseek-v3", seed=0))
    spec = load_spec(path)
    return path, spec, Shard.load(path, spec, 0, spec.num_layers)


def _pool(spec, token_layers=4096) -> KVBudget:
    pool = KVBudget(token_layers)
    heads, k_dim, v_dim = spec.kv_layout
    pool.bind(heads, k_dim, torch.float32, v_dim=v_dim)
    return pool


def test_the_cache_row_is_the_latent_and_the_rotary_key(tmp_path):
    """DeepSeek-V3 in bf16: 512 + 64 numbers a token and layer (1152 bytes) where full K and V of
    128 heads would take 128 x (192 + 128) (81920 bytes); what a peer's KV budget divides by
    (`kv_capacity`) and announces to the planner (``kv_entry_bytes``)."""
    from p2pserve.config import PeerConfig
    from p2pserve.peer.runtime import kv_capacity

    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3 | {"quantization_config": None}))
    spec = load_spec(tmp_path, dtype="bfloat16")
    assert spec.kv_layout == (1, 512, 64) and spec.kv_bytes_per_token_layer == 1152
    assert 128 * (192 + 128) * 2 // spec.kv_bytes_per_token_layer == 71
    config = PeerConfig(kv_memory_bytes=2**30)
    assert kv_capacity(config, spec) == 2**30 // 1152
    # 61 layers of ~11 B weights (every expert: ~669 B), ~36 B multiplied per token
    assert 660e9 < 61 * spec.layer_param_count < 675e9 and 34e9 < 61 * spec.layer_active_param_count < 38e9


def test_the_hub_checkpoints_block_fp8_weights_are_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3 | {"quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(UnsupportedModelError, match="deepseek_v3.*fp8"):
        load_spec(tmp_path)


def test_the_pool_holds_latents_and_a_batched_step_equals_each_session_alone(ds):
    """Three sessions of different lengths in one paged step (the exact grouped attention mode) give
    each the logits and tokens it gets alone (equal within fp32 rounding: the experts' matmuls
    group several sessions' tokens); the pool's rows are [S, 1, kv_lora_rank] and [S, 1, R]."""
    path, spec, shard = ds
    pool = _pool(spec)
    assert tuple(pool.k.shape[1:]) == (1, 128) and tuple(pool.v.shape[1:]) == (1, 64)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, spec.vocab_size - 8, (n,), generator=gen) for n in (9, 1, 14)]
    L = spec.num_layers

    def run(batch: list[int]):
        caches = {i: PagedCache(pool, 0, L, 64) for i in batch}
        first = shard.forward_batch([Segment(prompts[i], 0, 0, L, caches[i], want_logits=True) for i in batch])
        nxt = [torch.tensor([int(x.argmax())]) for x in first]
        second = shard.forward_batch([Segment(t, len(prompts[i]), 0, L, caches[i], want_logits=True)
                                      for t, i in zip(nxt, batch)])
        for c in caches.values():
            c.release()
        return first, second

    alone = [run([i]) for i in range(3)]
    first, second = run([0, 1, 2])
    for i in range(3):
        for got, want in ((first[i], alone[i][0][0]), (second[i], alone[i][1][0])):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert int(got.argmax()) == int(want.argmax())
    assert pool.used == 0


def test_a_chunked_prefill_over_the_pool_gives_the_whole_prompts_tokens(ds):
    path, spec, shard = ds
    pool = _pool(spec)
    x = torch.randint(3, spec.vocab_size - 8, (21,), generator=torch.Generator().manual_seed(5))
    L = spec.num_layers

    def greedy(chunk: int) -> list[int]:
        cache, out = PagedCache(pool, 0, L, 64), []
        for at in range(0, len(x), chunk):
            (logits,) = shard.forward_batch([Segment(x[at:at + chunk], at, 0, L, cache, want_logits=True)])
        for _ in range(6):
            out.append(int(logits.argmax()))
            (logits,) = shard.forward_batch([Segment(torch.tensor(out[-1:]), cache.length, 0, L, cache,
                                                     want_logits=True)])
        cache.release()
        return out

    assert greedy(8) == greedy(len(x))


def test_tensor_parallelism_refuses_latent_attention(ds):
    from p2pserve.errors import ConfigError
    from p2pserve.model.tensor_parallel import check_splittable

    with pytest.raises(ConfigError, match="latent attention"):
        check_splittable(ds[1], 2)
