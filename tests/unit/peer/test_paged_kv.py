"""The paged KV cache: block accounting, growth and rewind, admission, batched attention.

The batched attention path is compared with the per-sequence path (`SequenceCache`, one SDPA
call per sequence) on random batches of mixed lengths, prefill and decode together: its exact
mode (fp32) bit for bit; its padded mode (one call per layer) to fp32 rounding, since padding
changes SDPA's reduction lengths, with the same greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from p2pserve.errors import BadRequestError, OverloadedError
from p2pserve.model.attention import paged_batch
from p2pserve.model.shard import Segment, Shard
from p2pserve.model.spec import ModelSpec, load_spec
from p2pserve.model.tiny_families import build_family_model
from p2pserve.peer.kv_cache import KVBudget, PagedCache, SequenceCache
from p2pserve.peer.sessions import HEADROOM_TOKENS, SessionTable
from p2pserve.protocol import PROTOCOL_VERSION, OpenSession, SamplingParams


def _pool(blocks: int, nkv=2, d=4, block_size=4) -> KVBudget:
    pool = KVBudget(blocks * block_size, block_size=block_size)
    pool.bind(nkv, d, torch.float32)
    return pool


def test_pool_hands_out_blocks_and_refuses_when_full():
    pool = _pool(4)
    assert (pool.capacity, pool.free) == (16, 16) and float(pool.k[pool.pad_slot].abs().sum()) == 0
    ids = pool.take(3)
    assert sorted(ids) == [0, 1, 2] and pool.used == 12
    with pytest.raises(OverloadedError, match="KV cache full"):
        pool.take(2)
    assert pool.used == 12  # nothing taken by the refused call
    pool.give(ids[:2])
    assert pool.free == 12 and len(set(pool.take(3))) == 3
    with pytest.raises(BadRequestError):
        pool.take(5)  # more than the whole pool: no peer of this size can serve it


def test_paged_cache_matches_contiguous_cache_and_rewinds():
    pool = _pool(32)
    paged = PagedCache(pool, 2, 4, max_length=40)
    flat = SequenceCache(2, 4, num_kv_heads=2, head_dim=4, max_length=40, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    for n in (7, 1, 1, 9, 1):
        for layer in (2, 3):
            k, v = torch.randn(2, n, 4, generator=gen), torch.randn(2, n, 4, generator=gen)
            got, want = paged.append(layer, k, v), flat.append(layer, k, v)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert paged.length == 19 and paged.held == 5 * 4 * 2 == pool.used  # 5 blocks of 4 in 2 layers
    paged.truncate(6)  # a rewind gives back the blocks past position 6
    assert paged.length == 6 and pool.used == 2 * 4 * 2
    k, _ = paged.append(2, torch.zeros(2, 1, 4), torch.zeros(2, 1, 4))
    assert k.shape == (2, 7, 4) and float(k[:, 6].abs().sum()) == 0
    with pytest.raises(BadRequestError, match="max_length"):
        paged.reserve(41)
    paged.release()
    assert pool.used == 0


def test_growth_past_the_free_blocks_is_refused_without_taking_any():
    pool = _pool(4)
    a, b = PagedCache(pool, 0, 2, 64), PagedCache(pool, 0, 2, 64)
    a.reserve(8)  # 2 blocks x 2 layers: the whole pool
    with pytest.raises(OverloadedError, match="KV cache full"):
        b.reserve(1)
    assert b.held == 0 and pool.used == 16


def _spec(num_layers=8) -> ModelSpec:
    return ModelSpec(model_id="m", family="llama", hidden_size=8, num_layers=num_layers, num_heads=2, num_kv_heads=2,
                     head_dim=4, intermediate_size=16, vocab_size=16, dtype="float32", tie_word_embeddings=False,
                     max_position_embeddings=4096)


def _open(table, sid, max_length=2048, owner=None, start=0, end=8):
    return table.open(OpenSession(version=PROTOCOL_VERSION, model_id="m", session_id=sid, start=start, end=end,
                                  max_length=max_length, sampling=SamplingParams()), owner=owner)


def test_admission_counts_blocks_used_not_max_length():
    # 8 layers x 2048 max_length = 16384 token-layers: the old reservation admitted 2 sessions.
    from p2pserve.config import AdmissionConfig

    table = SessionTable(spec=_spec(), served=(0, 8), budget=KVBudget(32768), idle_timeout_s=60.0,
                         torch_dtype=torch.float32, admission=AdmissionConfig(max_kv_fraction_per_owner=1.0))
    sessions = [_open(table, f"s{i}") for i in range(200)]
    assert table.budget.used == 200 * HEADROOM_TOKENS * 8  # only the headroom block per layer
    table.grow(sessions[0], 300)  # 19 blocks per layer
    assert sessions[0].reserved == 19 * 16 * 8
    with pytest.raises(OverloadedError, match="KV cache full"):
        table.grow(sessions[1], 2048)
    assert sessions[1].reserved == HEADROOM_TOKENS * 8
    sessions[0].cache.truncate(10)  # rewind
    assert sessions[0].reserved == HEADROOM_TOKENS * 8
    table.close("s0", None)
    assert table.budget.used == 199 * HEADROOM_TOKENS * 8


def test_one_owner_may_not_grow_past_its_share():
    table = SessionTable(spec=_spec(), served=(0, 8), budget=KVBudget(16384), idle_timeout_s=60.0,
                         torch_dtype=torch.float32)  # default share: half the pool per owner
    s = _open(table, "a")
    with pytest.raises(OverloadedError, match="one client may hold"):
        table.grow(s, 1100)
    table.grow(s, 1000)


def _segments(spec, caches, lengths, gen, want_logits):
    segs = []
    for cache, n in zip(caches, lengths):
        x = torch.randint(0, spec.vocab_size, (n,), generator=gen)
        segs.append(Segment(x, cache.length, 0, spec.num_layers, cache, want_logits=want_logits))
    return segs


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "padded"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gpt-oss"])
def test_batched_paged_attention_agrees_with_per_sequence_attention(model_dir, tmp_path_factory, family, exact):
    """Exact mode (fp32's default): bit-identical to per-sequence attention. Padded mode (one
    call per layer, half precision's default): equal to rounding, same greedy tokens. GPT-OSS
    checks attention sinks and its alternating 16-token window on both."""
    path = (str(build_family_model(family, tmp_path_factory.mktemp(family) / family, seed=0))
            if family == "gpt-oss" else model_dir(family))
    spec = load_spec(path)
    shard = Shard.load(path, spec, 0, spec.num_layers)
    pool = KVBudget(64 * 1024)
    pool.bind(spec.num_kv_heads, spec.head_dim, torch.float32)
    pool.exact = exact
    b = 5
    paged = [PagedCache(pool, 0, spec.num_layers, 256) for _ in range(b)]
    flat = [SequenceCache(0, spec.num_layers, spec.num_kv_heads, spec.head_dim, 256, torch.float32) for _ in range(b)]
    gen = torch.Generator().manual_seed(1)
    # Mixed steps: prefills of different lengths, then decodes mixed with a late prefill and a
    # second chunk; lengths cross block boundaries and mistral's sliding window; two sessions
    # share a shape (3 then 1 new tokens at equal lengths) so that groups of several run.
    plan = [[3, 17, 3, 9, 30], [1, 1, 1, 1, 1], [1, 12, 1, 1, 5], [1, 1, 20, 1, 1], [1, 1, 1, 1, 1]]
    for step, lengths in enumerate(plan):
        seed = int(torch.randint(0, 2**31, (1,), generator=gen))
        got = shard.forward_batch(_segments(spec, paged, lengths, torch.Generator().manual_seed(seed), True))
        want = shard.forward_batch(_segments(spec, flat, lengths, torch.Generator().manual_seed(seed), True))
        for g, w in zip(got, want):
            if exact:
                assert torch.equal(g, w), f"step {step}: exact mode differs from per-sequence attention"
            # GPT-OSS: its routed experts carry rounding through six layers (and may route a token
            # differently near a tie), hence the MoE tests' 1e-4.
            tol = 1e-4 if family == "gpt-oss" else 1e-5
            torch.testing.assert_close(g, w, rtol=tol, atol=tol)
            assert int(g.argmax()) == int(w.argmax()), f"step {step}: greedy token differs"
    assert [c.length for c in paged] == [c.length for c in flat]
    for c in paged:
        c.release()
    assert pool.used == 0


@pytest.mark.parametrize("threads", [1, 2])
def test_exact_mode_of_one_shape_is_one_call_in_batch_order(model_dir, threads):
    """Sixteen decodes at one length are one group: the batch's tokens in order, bit-identical
    (one SDPA call with one thread; member by member with several, see `PagedBatch`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _one_shape_batch(model_dir)
    finally:
        torch.set_num_threads(before)


def _one_shape_batch(model_dir):
    path = model_dir("llama")
    spec = load_spec(path)
    shard = Shard.load(path, spec, 0, spec.num_layers)
    pool = KVBudget(64 * 1024)
    pool.bind(spec.num_kv_heads, spec.head_dim, torch.float32)
    paged = [PagedCache(pool, 0, spec.num_layers, 64) for _ in range(16)]
    flat = [SequenceCache(0, spec.num_layers, spec.num_kv_heads, spec.head_dim, 64, torch.float32) for _ in range(16)]
    for lengths in ([7] * 16, [1] * 16, [1] * 16):
        seed = int(torch.randint(0, 2**31, (1,)))
        segs = _segments(spec, paged, lengths, torch.Generator().manual_seed(seed), True)
        batch = paged_batch(segs)
        assert len(batch.groups) == 1 and batch.in_order
        for c in paged:  # paged_batch claimed the step's room: give it back, forward_batch claims again
            c.truncate(c.length - lengths[0])
        got = shard.forward_batch(segs)
        want = shard.forward_batch(_segments(spec, flat, lengths, torch.Generator().manual_seed(seed), True))
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_padded_mode_runs_decodes_apart_from_prompt_chunks(model_dir):
    """Half precision's padded mode: a step of decodes and one prompt chunk is two calls per
    layer, the decodes unpadded (one query row each, not the chunk's length), and agrees with
    per-sequence attention to rounding."""
    path = model_dir("llama")
    spec = load_spec(path)
    shard = Shard.load(path, spec, 0, spec.num_layers)
    pool = KVBudget(64 * 1024)
    pool.bind(spec.num_kv_heads, spec.head_dim, torch.float32)
    pool.exact = False
    paged = [PagedCache(pool, 0, spec.num_layers, 64) for _ in range(4)]
    flat = [SequenceCache(0, spec.num_layers, spec.num_kv_heads, spec.head_dim, 64, torch.float32) for _ in range(4)]
    for lengths in ([5, 9, 3, 7], [1, 1, 12, 1]):
        seed = int(torch.randint(0, 2**31, (1,)))
        segs = _segments(spec, paged, lengths, torch.Generator().manual_seed(seed), True)
        batch = paged_batch(segs)
        for c, n in zip(paged, lengths):  # paged_batch claimed the step's room: give it back
            c.truncate(c.length - n)
        got = shard.forward_batch(segs)
        want = shard.forward_batch(_segments(spec, flat, lengths, torch.Generator().manual_seed(seed), True))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert [(part.mq, part.tokens.tolist()) for part in batch.parts] == [(1, [0, 1, 14]), (12, list(range(2, 14)))]
    assert not batch.in_order


def test_a_lone_paged_session_is_bit_identical_to_the_contiguous_cache(model_dir):
    path = model_dir("llama")
    spec = load_spec(path)
    shard = Shard.load(path, spec, 0, spec.num_layers)
    pool = KVBudget(16 * 1024)
    pool.bind(spec.num_kv_heads, spec.head_dim, torch.float32)
    paged = PagedCache(pool, 0, spec.num_layers, 128)
    flat = SequenceCache(0, spec.num_layers, spec.num_kv_heads, spec.head_dim, 128, torch.float32)
    for n in (13, 1, 1, 1, 4, 1):
        x = torch.randint(0, spec.vocab_size, (n,))
        got = shard.forward_batch([Segment(x, paged.length, 0, spec.num_layers, paged, want_logits=True)])
        want = shard.forward_batch([Segment(x, flat.length, 0, spec.num_layers, flat, want_logits=True)])
        assert torch.equal(got[0], want[0])
