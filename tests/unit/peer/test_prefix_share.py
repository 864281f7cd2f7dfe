"""Prefix sharing of paged KV blocks: keyed by the content the peer received, copy-on-write.

The attack: a hostile session that shares a victim's prefix blocks (by sending the same
prompt) rewinds into them and writes other tokens, trying to change what the victim's later
steps attend to; and a session whose inputs differ from the victim's by one bit tries to be
handed the victim's blocks. Neither may change a bit of the victim's outputs.
"""

from __future__ import annotations

import torch

from p2pserve.model.shard import Segment, Shard
from p2pserve.model.spec import load_spec
from p2pserve.peer.kv_cache import KVBudget, PagedCache, SequenceCache


def _setup(model_dir, start=0, end=None):
    path = model_dir("llama")
    spec = load_spec(path)
    end = spec.num_layers if end is None else end
    shard = Shard.load(path, spec, start, end)
    pool = KVBudget(256 * (end - start) * 16)
    pool.bind(spec.num_kv_heads, spec.head_dim, torch.float32)
    return spec, shard, pool


def _step(shard, cache, x, logits=True):
    """One step as the worker runs it: forward, then the content keys of the blocks it filled."""
    pos = cache.length
    out = shard.forward_batch([Segment(x, pos, shard.start, shard.end, cache, want_logits=logits)])[0]
    if isinstance(cache, PagedCache):
        cache.note_written(x, pos)
    return out


def test_equal_prompts_share_full_blocks_and_diverging_tails_do_not(model_dir):
    spec, shard, pool = _setup(model_dir)
    L = spec.num_layers
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(0, spec.vocab_size, (40,), generator=gen)  # 2 full blocks + 8
    a, b = PagedCache(pool, 0, L, 128), PagedCache(pool, 0, L, 128)
    _step(shard, a, system)
    alone = pool.used
    tail = torch.randint(0, spec.vocab_size, (5,), generator=gen)
    _step(shard, b, torch.cat([system, tail]))
    # b holds 3 blocks per layer, 2 of them a's: the pool holds 3 + 1 per layer, not 3 + 3.
    assert a.held == 3 * 16 * L and b.held == 3 * 16 * L
    assert pool.used == alone + 16 * L
    assert a._tables[0][:2] == b._tables[0][:2] and a._tables[0][2] != b._tables[0][2]
    a.release()
    assert pool.used == 3 * 16 * L  # b's blocks, the shared ones included, stay
    b.release()
    assert pool.used == 0 and len(pool.prefixes) == 0


def test_shared_prefix_outputs_are_bit_identical_to_an_unshared_cache(model_dir):
    """Shared blocks hold the bytes the first session computed: a session that feeds its prompt
    in the same chunks gets the very outputs of an unshared cache. Fed in other chunks (as
    chunked prefill may), its own positions round differently, as they would unshared: the
    greedy tokens still agree."""
    spec, shard, pool = _setup(model_dir)
    L = spec.num_layers
    gen = torch.Generator().manual_seed(1)
    system = torch.randint(0, spec.vocab_size, (33,), generator=gen)
    tail = torch.randint(0, spec.vocab_size, (3,), generator=gen)
    first = PagedCache(pool, 0, L, 128)
    _step(shard, first, system)
    for chunks, exact in (((system, tail), True), ((torch.cat([system, tail])[:20], torch.cat([system, tail])[20:]), False)):
        shared = PagedCache(pool, 0, L, 128)
        flat = SequenceCache(0, L, spec.num_kv_heads, spec.head_dim, 128, torch.float32)
        for chunk in (system, tail):
            want = _step(shard, flat, chunk)
        for chunk in chunks:
            got = _step(shard, shared, chunk)
        assert shared._tables[0][:2] == first._tables[0][:2]
        for _ in range(20):  # greedy decode over the shared blocks
            assert torch.equal(got, want) if exact else int(got.argmax()) == int(want.argmax())
            token = want.argmax().reshape(1)
            got, want = _step(shard, shared, token), _step(shard, flat, token)
        shared.release()


def test_attack_rewind_into_shared_blocks_copies_them_and_the_victim_is_unchanged(model_dir):
    spec, shard, pool = _setup(model_dir)
    L = spec.num_layers
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, spec.vocab_size, (48,), generator=gen)  # 3 full blocks
    victim, hostile = PagedCache(pool, 0, L, 128), PagedCache(pool, 0, L, 128)
    ref = SequenceCache(0, L, spec.num_kv_heads, spec.head_dim, 128, torch.float32)
    _step(shard, victim, prompt)
    _step(shard, ref, prompt)
    _step(shard, hostile, prompt)
    assert victim._tables[5] == hostile._tables[5]  # every block shared
    shared_block = victim._tables[0][1]
    hostile.truncate(20)  # into the second block, held by both
    hostile.reserve(30)  # what the peer's grow() does before the hostile Forward runs
    assert hostile._tables[0][1] != shared_block and victim._tables[0][1] == shared_block
    _step(shard, hostile, torch.randint(0, spec.vocab_size, (10,), generator=gen))
    hostile.truncate(32)  # at a block boundary: the first two blocks stay shared, the third is let go
    _step(shard, hostile, torch.randint(0, spec.vocab_size, (16,), generator=gen))
    token = torch.tensor([7])
    for _ in range(6):
        got, want = _step(shard, victim, token), _step(shard, ref, token)
        assert torch.equal(got, want)
        token = got.argmax().reshape(1)
    hostile.release()
    victim.release()
    assert pool.used == 0


def test_attack_inputs_one_bit_apart_share_nothing(model_dir):
    """Hidden-state inputs (a later hop): the key is their bytes, so a flipped bit is another key."""
    spec, shard, pool = _setup(model_dir, 2, 5)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(32, spec.hidden_size, generator=gen)
    forged = hidden.clone()
    forged.view(torch.int32)[31, 0] ^= 1  # one bit of the last row of the second block
    a, b, c = (PagedCache(pool, 2, 5, 64) for _ in range(3))
    _step(shard, a, hidden, logits=False)
    _step(shard, b, forged, logits=False)
    _step(shard, c, hidden.clone(), logits=False)
    assert a._tables[0][0] == b._tables[0][0] and a._tables[0][1] != b._tables[0][1]
    assert a._tables[0] == c._tables[0]
    # Token ids whose bytes equal some hidden row's still have another key (the dtype is in the root).
    assert len(pool.prefixes) == 3


def test_attack_sole_holder_rewrites_its_registered_block_and_later_sessions_do_not_get_it(model_dir):
    """A session alone with its keyed blocks rewinds into one and writes other tokens: the block
    leaves the index, so a later session with the original prompt computes its own."""
    spec, shard, pool = _setup(model_dir)
    L = spec.num_layers
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, spec.vocab_size, (32,), generator=gen)
    hostile = PagedCache(pool, 0, L, 128)
    _step(shard, hostile, prompt)
    registered = hostile._tables[0][1]
    hostile.truncate(20)
    _step(shard, hostile, torch.randint(0, spec.vocab_size, (12,), generator=gen))  # refills block 1
    assert hostile._tables[0][1] == registered  # written in place: it held it alone
    victim = PagedCache(pool, 0, L, 128)
    ref = SequenceCache(0, L, spec.num_kv_heads, spec.head_dim, 128, torch.float32)
    got, want = _step(shard, victim, prompt), _step(shard, ref, prompt)
    assert victim._tables[0][0] == hostile._tables[0][0]  # the untouched first block is shared
    assert victim._tables[0][1] != registered
    token = torch.tensor([3])
    for _ in range(4):
        assert torch.equal(got, want)
        got, want = _step(shard, victim, token), _step(shard, ref, token)
        token = want.argmax().reshape(1)


def test_a_fork_shares_the_parents_blocks_and_neither_writes_into_the_others(model_dir):
    """A session forked at a position inside a block (``PagedCache.fork``) holds the parent's
    blocks without new ones; each then writes its own tokens there, copying the shared block
    first, and both decode exactly as unshared caches fed the same tokens."""
    spec, shard, pool = _setup(model_dir)
    L = spec.num_layers
    prompt = torch.randint(0, spec.vocab_size, (37,), generator=torch.Generator().manual_seed(2))
    parent = PagedCache(pool, 0, L, 128)
    _step(shard, parent, prompt)
    used = pool.used
    child = PagedCache(pool, 0, L, 128)
    child.fork(parent, 36)
    assert pool.used == used and child.length == 36 and child._tables == parent._tables
    flats = [SequenceCache(0, L, spec.num_kv_heads, spec.head_dim, 128, torch.float32) for _ in range(2)]
    _step(shard, flats[0], prompt)
    _step(shard, flats[1], prompt[:36])
    want_child = _step(shard, flats[1], torch.tensor([5]))
    assert torch.equal(_step(shard, child, torch.tensor([5])), want_child)  # child's own row 36
    for token in (7, 9, 11):  # both go on in the block they shared, each in its own copy now
        t = torch.tensor([token])
        assert torch.equal(_step(shard, parent, t), _step(shard, flats[0], t))
        assert torch.equal(_step(shard, child, t + 1), _step(shard, flats[1], t + 1))
    assert parent._tables[0][2] != child._tables[0][2] and parent._tables[0][:2] == child._tables[0][:2]
    parent.release()
    child.release()
    assert pool.used == 0


def test_only_the_owners_idle_session_over_the_same_span_can_be_forked(tmp_path):
    import pytest

    from p2pserve.errors import BadRequestError
    from p2pserve.protocol import PROTOCOL_VERSION, OpenSession
    from tests.harness import tiny_session_table

    _, spec, _, table = tiny_session_table(tmp_path)
    parent = table.open(OpenSession(version=PROTOCOL_VERSION, model_id=spec.model_id, session_id="p", start=0,
                                    end=spec.num_layers, max_length=64), owner="s1", principal="alice")
    parent.cache.reserve(20)
    parent.cache.claim(20)
    parent.chain.extend([b"x" * 32] * 20)

    def fork(name, principal, at=10, start=0):
        return table.open(OpenSession(version=PROTOCOL_VERSION, model_id=spec.model_id, session_id=name, start=start,
                                      end=spec.num_layers, max_length=64, fork_of="p", fork_at=at),
                          owner="s2", principal=principal)

    with pytest.raises(BadRequestError, match="of yours"):
        fork("mallory", "mallory")
    for name, at, start in (("far", 21, 0), ("span", 10, 1), ("zero", 0, 0)):
        with pytest.raises(BadRequestError):
            fork(name, "alice", at, start)
    child = fork("c", "alice")
    assert child.position == 10 and child.chain.links == parent.chain.links[:11]
