"""Decode attention over the paged KV pool on CPU in half precision: a C kernel, else one gather
and a compiled kernel.

A batched decode step attends b queries (one token each) to their sequences' cached keys and
values, which live in scattered rows of the pool. The eager path (`attention.PagedBatch`) gathers
those rows into padded [b, nKV, mk, D] copies, up-casts the copies to fp32 and calls SDPA: on a
2-core CPU, 32 SmolLM2 sequences of about 200 tokens, the gather, the up-cast and the kernel were
each about a third of the attention's time, and attention about half of the whole step.

Two kernels do better, both in fp32 with one rounding of the output to the pool's dtype, so they
agree with the eager path to that rounding:

* **The C kernel** (bf16 pools; ``kernels/decode_attention.c``, built for the host by
  `c_kernel`): one task per sequence reads each of its pool rows once, in place, every head of
  the row while it is in cache, with rows a few positions ahead prefetched. No gathered copy,
  and a sequence's result depends on its own rows only: not on the batch or the thread count.
  Timed alone over 30 layers' cold rows (32 sequences of 144 keys, SmolLM2's heads): 7.5 ms at
  2 threads against 19 for the eager path and 20 for the compiled one; 15 ms at 1 thread against
  28-30 compiled (docs/engine.md).
* **The compiled kernel** (fp16 pools, or no C compiler): the rows are gathered once in the
  pool's dtype (``index_select``), and the arithmetic on the dense copy is written as plain tensor
  ops compiled once by ``torch.compile`` (inductor's C++ backend) with dynamic batch and key
  lengths; inductor fuses the up-casts into the reductions. It serves one-thread steps only:
  with two threads it lost to the eager path's SDPA inside steps (16-17 against 13.5 ms).

Both are deterministic and run the same rows in one process and in a swarm, so the same step
gives the same bits anywhere.

Shapes: b sequences, mk = longest key length in the step, nH / nKV query / key-value heads,
G = nH / nKV, D = head dim, S = pool rows.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import types

import torch

from p2pserve.model import c_kernel

log = logging.getLogger(__name__)

_lock = threading.Lock()
_compiled = None  # the compiled kernel, made on first use in this process
_failed = False  # compiling failed once (no C++ toolchain, say): the eager path serves from then on
_native: ctypes.CDLL | None = None  # the C kernel's library, once looked for (``_looked``)
_looked = False


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
            scale: float) -> torch.Tensor:
    """q [b, nH, D]; k, v [b, mk, nKV, D] each sequence's gathered keys and values (padding
    anywhere past ``hi``); key j of sequence i counts when lo[i] <= j < hi[i] ([b]).
    Returns [b, nH * D] in q's dtype."""
    b, mk, nKV, D = k.shape
    G = q.shape[1] // nKV
    qg = q.float().view(b, 1, nKV, G, D)
    s = (qg * k.float()[:, :, :, None, :]).sum(-1) * scale  # [b, mk, nKV, G]; the up-cast is fused, never stored
    pos = torch.arange(mk, device=q.device)[None, :]
    valid = ((pos >= lo[:, None]) & (pos < hi[:, None]))[:, :, None, None]  # [b, mk, 1, 1]
    p = torch.softmax(s.masked_fill(~valid, float("-inf")), dim=1)
    o = (p[..., None] * v.float()[:, :, :, None, :]).sum(1)  # [b, nKV, G, D]
    return o.reshape(b, nKV * G * D).to(q.dtype)


def gather_rows(rows: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """Pool rows [S, nKV, D] at ``read`` [b, mk] -> [b, mk, nKV, D] (``index_select`` over flat
    rows: several times faster than advanced indexing on CPU); the eager padded path gathers
    with it too."""
    return rows.view(rows.shape[0], -1).index_select(0, read.view(-1)).view(*read.shape, *rows.shape[1:])


def _library():
    """The C kernel's library, built and loaded on first use; None where it cannot be."""
    global _native, _looked
    if not _looked:
        lib = c_kernel.load("decode_attention")
        if lib is not None:
            lib.p2p_decode_attend_bf16.restype = ctypes.c_int
            lib.p2p_decode_attend_bf16.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 5 + [ctypes.c_float]
        _native, _looked = lib, True
    return _native


def native(pool) -> bool:
    """Whether decodes over ``pool`` run the C kernel: a CPU bf16 pool of contiguous rows, keys and
    values of one shape, where the kernel could be built."""
    k, v = pool.k, pool.v
    if k.dtype != torch.bfloat16 or v.dtype != k.dtype or k.shape != v.shape or k.device.type != "cpu":
        return False
    return k.is_contiguous() and v.is_contiguous() and _library() is not None


def applies(pool, device: torch.device) -> bool:
    """Whether decodes over ``pool`` run a kernel of this module: a CPU pool in half precision
    (fp32 keeps the exact grouped path; GPUs keep their native half-precision SDPA), unless the
    pool says otherwise (``pool.fused = False``, as ``pool.exact`` picks the padded mode); the C
    kernel at any thread count, the compiled one in one-thread steps only.

    The compiled kernel's one-thread rule is by measurement: inside a step, with one thread it
    beat the eager path's SDPA (21 against 24 ms of a 60 ms step, 32 sequences of 130 keys), and
    with two it lost (16-17 against 13.5 ms of a 40 ms step), timed inside the steps of
    ``benchmarks/step.py --ab`` (docs/engine.md)."""
    if device.type != "cpu" or pool.k.dtype not in (torch.bfloat16, torch.float16) or not getattr(pool, "fused", True):
        return False
    if pool.k.shape[-1] != pool.v.shape[-1]:
        return False
    return native(pool) or (not _failed and torch.get_num_threads() == 1)


def attend(q: torch.Tensor, pool, read: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
           scale: float) -> torch.Tensor | None:
    """[b, nH * D] for decode queries q [b, nH, D] (see `_attend`): the C kernel's where it serves
    ``pool`` (`native`), else the compiled kernel's; None when neither can run here (then the
    caller's eager path runs)."""
    global _compiled, _failed
    if native(pool) and read.stride(-1) == 1:
        return _native_attend(q, pool, read, lo, hi, scale)
    if _compiled is None:
        with _lock:
            if _compiled is None and not _failed:
                _compiled = torch.compile(_attend, dynamic=True)
    if _compiled is None:
        return None
    try:
        return _compiled(q, gather_rows(pool.k, read), gather_rows(pool.v, read), lo, hi, scale)
    except Exception as e:  # noqa: BLE001 - a missing toolchain must not take the peer down
        _failed = True
        log.warning("compiled decode attention unavailable (%s: %s); using the eager path", type(e).__name__, e)
        return None


def _native_attend(q: torch.Tensor, pool, read: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """The C kernel over the pool rows in place (``read`` [b, mk] may be a view with any row stride)."""
    b, nH, D = q.shape
    q = q.contiguous()
    lo, hi = lo.to(torch.int64).contiguous(), hi.to(torch.int64).contiguous()
    read = read.to(torch.int64)
    out = torch.empty(b, nH * D, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    lib = _library()
    assert lib is not None, "native(pool) said the kernel is loaded"
    failed = lib.p2p_decode_attend_bf16(
        q.data_ptr(), pool.k.data_ptr(), pool.v.data_ptr(), read.data_ptr(), lo.data_ptr(), hi.data_ptr(),
        out.data_ptr(), b, nH, pool.k.shape[1], D, read.stride(0), scale)
    if failed:
        raise MemoryError("the decode attention kernel could not allocate its scratch memory")
    return out


def warm(dtype: torch.dtype, num_heads: int, kv_layout: tuple[int, int, int], device: torch.device) -> None:
    """Compile the kernel now (on the calling thread, which should be the one that will run it:
    the kernel's thread count is the caller's), if it applies to a pool of ``dtype`` with the
    model's ``kv_layout`` (KV heads, key dim, value dim: `ModelSpec.kv_layout`) on ``device``.

    The tensors are made as a step makes them (the pool outside inference mode, the step's own
    inside), since that is part of what a compiled graph is specialised on. The sizes are dynamic
    from the first compile on; the warm-up's batch and lengths are chosen apart from the model's
    head counts and dims, since sizes equal at compile time would be assumed equal later."""
    num_kv_heads, head_dim, v_dim = kv_layout
    taken = {0, 1, num_heads, num_kv_heads, head_dim, v_dim}
    b, mk, rows = (next(n for n in range(start, start + 64) if n not in taken) for start in (2, 7, 97))
    pool = types.SimpleNamespace(k=torch.zeros(rows, num_kv_heads, head_dim, dtype=dtype, device=device),
                                 v=torch.zeros(rows, num_kv_heads, v_dim, dtype=dtype, device=device))
    if not applies(pool, device):
        return
    with torch.inference_mode():
        read = torch.zeros(b, mk, dtype=torch.long, device=device)
        hi = torch.full((b,), mk, dtype=torch.long, device=device)
        q = torch.zeros(b, num_heads, head_dim, dtype=dtype, device=device)
        attend(q, pool, read, torch.zeros_like(hi), hi, 1.0)
