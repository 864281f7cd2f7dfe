"""The decode attention kernels over the paged pool (the C kernel for bf16, the compiled one for
fp16 and where no C compiler is) agree with per-sequence SDPA to one rounding."""

from __future__ import annotations

import types

import pytest
import torch

from p2pserve.model import decode_attention
from p2pserve.model.attention import attention_mask, sdpa


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _pool(rows: int, nkv: int, d: int, gen: torch.Generator, dtype=torch.bfloat16):
    k = (torch.randn(rows, nkv, d, generator=gen) * 0.5).to(dtype)
    v = (torch.randn(rows, nkv, d, generator=gen) * 0.5).to(dtype)
    return types.SimpleNamespace(k=k, v=v)


def _case(gen: torch.Generator, dtype, window):
    """Five sequences of uneven lengths over one pool: (pool, q, read, lo, hi)."""
    nh, nkv, d = 6, 2, 16
    pool = _pool(200, nkv, d, gen, dtype)
    lengths = [3, 17, 9, 1, 12]
    read = torch.zeros(len(lengths), max(lengths), dtype=torch.long)  # padding reads row 0
    for j, n in enumerate(lengths):
        read[j, :n] = torch.randperm(199, generator=gen)[:n] + 1
    hi = torch.tensor(lengths)
    lo = (hi - window).clamp(min=0) if window else torch.zeros_like(hi)
    q = torch.randn(len(lengths), nh, d, generator=gen).to(dtype)
    return pool, q, read, lo, hi


def _check_against_sdpa(got, pool, q, read, hi, window):
    assert got is not None and got.shape == (q.shape[0], q.shape[1] * q.shape[2]) and got.dtype == q.dtype
    for j, n in enumerate(hi.tolist()):
        rows = read[j, :n]
        keys, values = pool.k[rows].transpose(0, 1)[None], pool.v[rows].transpose(0, 1)[None]  # [1, nkv, n, d]
        mask = attention_mask(1, n, window, q.device)
        want = sdpa(q[j][None, :, None], keys, values, mask, 0.25).reshape(-1)
        torch.testing.assert_close(got[j], want, rtol=1e-2, atol=1e-2)  # one half-precision rounding apart


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window", [None, 5])
@torch.inference_mode()
def test_the_c_kernel_agrees_with_per_sequence_attention_and_depends_on_nothing_else(window, threads):
    torch.set_num_threads(threads)
    pool, q, read, lo, hi = _case(torch.Generator().manual_seed(0), torch.bfloat16, window)
    assert decode_attention.native(pool), "this machine builds C kernels (the peer's torch.compile needs a compiler too)"
    got = decode_attention.attend(q, pool, read, lo, hi, 0.25)
    _check_against_sdpa(got, pool, q, read, hi, window)
    assert torch.equal(got, decode_attention.attend(q, pool, read, lo, hi, 0.25))  # deterministic
    # a sequence's bits are its own: alone, with a wider read table, or at another thread count
    wide = torch.cat([read, torch.zeros(read.shape[0], 7, dtype=torch.long)], dim=1)[:, : read.shape[1] + 7]
    assert torch.equal(got, decode_attention.attend(q, pool, wide, lo, hi, 0.25))
    torch.set_num_threads(3 - threads)
    for j in range(q.shape[0]):
        alone = decode_attention.attend(q[j:j + 1], pool, read[j:j + 1], lo[j:j + 1], hi[j:j + 1], 0.25)
        assert alone is not None and torch.equal(alone[0], got[j])


@pytest.mark.parametrize("window", [None, 5])
@torch.inference_mode()
def test_the_compiled_kernel_agrees_with_per_sequence_attention_to_rounding(window):
    pool, q, read, lo, hi = _case(torch.Generator().manual_seed(0), torch.float16, window)
    assert not decode_attention.native(pool) and decode_attention.applies(pool, torch.device("cpu"))
    got = decode_attention.attend(q, pool, read, lo, hi, 0.25)
    _check_against_sdpa(got, pool, q, read, hi, window)
    assert torch.equal(got, decode_attention.attend(q, pool, read, lo, hi, 0.25))


def test_fp32_gpu_and_multi_thread_fp16_steps_keep_their_own_paths():
    gen = torch.Generator().manual_seed(1)
    pool = _pool(8, 1, 4, gen)
    fp32 = types.SimpleNamespace(k=pool.k.float(), v=pool.v.float())
    half = types.SimpleNamespace(k=pool.k.half(), v=pool.v.half())
    assert not decode_attention.applies(fp32, torch.device("cpu"))
    assert not decode_attention.applies(pool, torch.device("cuda"))
    torch.set_num_threads(2)  # the C kernel serves any thread count; the compiled one, one thread
    assert decode_attention.applies(pool, torch.device("cpu"))
    assert not decode_attention.applies(half, torch.device("cpu"))
    torch.set_num_threads(1)
    assert decode_attention.applies(half, torch.device("cpu"))
    pool.fused = False  # a pool may keep the eager path (benchmarks/step.py compares the two)
    assert not decode_attention.applies(pool, torch.device("cpu"))


def test_a_warmed_compiled_kernel_serves_other_batch_sizes_and_lengths_without_compiling_again():
    from torch._dynamo.utils import counters

    nh, nkv, d = 6, 2, 16
    decode_attention.warm(torch.float16, nh, (nkv, d, d), torch.device("cpu"))
    pool = _pool(300, nkv, d, torch.Generator().manual_seed(2), torch.float16)  # outside inference mode, as the peer's
    compiled = counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        for b, mk in ((32, 210), (3, 6), (2, 2)):
            read = torch.randint(0, 300, (b, mk))
            hi = torch.full((b,), mk)
            assert decode_attention.attend(torch.randn(b, nh, d).half(), pool, read, hi * 0, hi, 0.25) is not None
    assert counters["stats"]["unique_graphs"] == compiled
