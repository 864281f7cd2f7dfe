"""The compiled decode attention over the paged pool agrees with the eager padded path."""

from __future__ import annotations

import types

import pytest
import torch

from p2pserve.model import decode_attention
from p2pserve.model.attention import attention_mask, sdpa


@pytest.fixture(autouse=True)
def one_thread():
    """The kernel serves one-thread steps (`decode_attention.applies`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _pool(rows: int, nkv: int, d: int, gen: torch.Generator):
    k = (torch.randn(rows, nkv, d, generator=gen) * 0.5).bfloat16()
    v = (torch.randn(rows, nkv, d, generator=gen) * 0.5).bfloat16()
    return types.SimpleNamespace(k=k, v=v)


@pytest.mark.parametrize("window", [None, 5])
@torch.inference_mode()
def test_compiled_decodes_agree_with_per_sequence_attention_to_rounding(window):
    gen = torch.Generator().manual_seed(0)
    nh, nkv, d = 6, 2, 16
    pool = _pool(200, nkv, d, gen)
    lengths = [3, 17, 9, 1, 12]
    mk = max(lengths)
    read = torch.zeros(len(lengths), mk, dtype=torch.long)  # padding reads row 0
    for j, n in enumerate(lengths):
        read[j, :n] = torch.randperm(199, generator=gen)[:n] + 1
    hi = torch.tensor(lengths)
    lo = (hi - window).clamp(min=0) if window else torch.zeros_like(hi)
    q = torch.randn(len(lengths), nh, d, generator=gen).bfloat16()
    assert decode_attention.applies(pool, torch.device("cpu"))
    got = decode_attention.attend(q, pool, read, lo, hi, 0.25)
    assert got is not None and got.shape == (len(lengths), nh * d) and got.dtype == torch.bfloat16
    for j, n in enumerate(lengths):
        rows = read[j, :n]
        keys, values = pool.k[rows].transpose(0, 1)[None], pool.v[rows].transpose(0, 1)[None]  # [1, nkv, n, d]
        mask = attention_mask(1, n, window, q.device)
        want = sdpa(q[j][None, :, None], keys, values, mask, 0.25).reshape(-1)
        torch.testing.assert_close(got[j], want, rtol=1e-2, atol=1e-2)  # one bf16 rounding apart
    again = decode_attention.attend(q, pool, read, lo, hi, 0.25)
    assert torch.equal(got, again)  # deterministic


def test_fp32_gpu_and_multi_thread_steps_keep_their_own_paths():
    gen = torch.Generator().manual_seed(1)
    pool = _pool(8, 1, 4, gen)
    fp32 = types.SimpleNamespace(k=pool.k.float(), v=pool.v.float())
    assert not decode_attention.applies(fp32, torch.device("cpu"))
    assert not decode_attention.applies(pool, torch.device("cuda"))
    assert decode_attention.applies(pool, torch.device("cpu"))
    torch.set_num_threads(2)  # several threads split the eager path's SDPA better
    assert not decode_attention.applies(pool, torch.device("cpu"))
    torch.set_num_threads(1)
    pool.fused = False  # a pool may keep the eager path (benchmarks/step.py compares the two)
    assert not decode_attention.applies(pool, torch.device("cpu"))


def test_a_warmed_kernel_serves_other_batch_sizes_and_lengths_without_compiling_again():
    from torch._dynamo.utils import counters

    nh, nkv, d = 6, 2, 16
    decode_attention.warm(torch.bfloat16, nh, (nkv, d, d), torch.device("cpu"))
    pool = _pool(300, nkv, d, torch.Generator().manual_seed(2))  # made as the peer's pool is: outside inference mode
    compiled = counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        for b, mk in ((32, 210), (3, 6), (2, 2)):
            read = torch.randint(0, 300, (b, mk))
            hi = torch.full((b,), mk)
            assert decode_attention.attend(torch.randn(b, nh, d).bfloat16(), pool, read, hi * 0, hi, 0.25) is not None
    assert counters["stats"]["unique_graphs"] == compiled
