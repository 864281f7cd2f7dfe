"""Decode attention over the paged KV pool: one gather, then one compiled kernel (CPU half precision).

A batched decode step attends b queries (one token each) to their sequences' cached keys and
values, which live in scattered rows of the pool. The eager path (`attention.PagedBatch`) gathers
those rows into padded [b, nKV, mk, D] copies, up-casts the copies to fp32 and calls SDPA: on a
2-core CPU, 32 SmolLM2 sequences of about 200 tokens, the gather, the up-cast and the kernel were
each about a third of the attention's time, and attention about half of the whole step.

Here the rows are gathered once, in the pool's dtype (``index_select``: a streaming copy of whole
rows, the fastest gather measured), and the arithmetic on the dense copy (fp32 dot products,
masked softmax, weighted sum) is written as plain tensor ops and compiled once by
``torch.compile`` (inductor's C++ backend) with dynamic batch and key lengths. Inductor fuses the
up-casts into the loops of the two reductions, so no fp32 copy is made. A first version fused
the gather into those loops too; it read the pool row by row inside every reduction (three heads
of a group, two halves of a head: six passes over each value row), and on cold rows it was slower
than the eager path (2 cores, 32 sequences of 144 keys, 30 layers' rows out of cache: 20 ms
against 19 eager and 13.5 for gather-then-compile; docs/engine.md has the figures inside steps).

Scores, softmax and the weighted sum accumulate in fp32, as SDPA's own kernel does, and the
output is rounded once to the pool's dtype; the result agrees with the eager path to that
rounding. The compiled kernel is deterministic and its row count is the batch's in one process
and in a swarm alike, so the same step gives the same bits anywhere.

Shapes: b sequences, mk = longest key length in the step, nH / nKV query / key-value heads,
G = nH / nKV, D = head dim, S = pool rows.
"""

from __future__ import annotations

import logging
import threading
import types

import torch

log = logging.getLogger(__name__)

_lock = threading.Lock()
_compiled = None  # the compiled kernel, made on first use in this process
_failed = False  # compiling failed once (no C++ toolchain, say): the eager path serves from then on


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


def applies(pool, device: torch.device) -> bool:
    """Whether decodes over ``pool`` run the compiled kernel: a CPU pool in half precision
    (fp32 keeps the exact grouped path; GPUs keep their native half-precision SDPA) stepped by
    one torch thread, unless the pool says otherwise (``pool.fused = False``, as ``pool.exact``
    picks the padded mode).

    One thread only, by measurement: inside a step, with one thread the kernel beat the eager
    path's SDPA (21 against 24 ms of a 60 ms step, 32 sequences of 130 keys), and with two it
    lost (16-17 against 13.5 ms of a 40 ms step): the attention's share, timed inside the steps
    of ``benchmarks/step.py --ab`` (docs/engine.md). Several threads split SDPA's batch well;
    the kernel's five reductions each end at a barrier."""
    return (device.type == "cpu" and pool.k.dtype in (torch.bfloat16, torch.float16) and not _failed
            and pool.k.shape[-1] == pool.v.shape[-1] and getattr(pool, "fused", True)
            and torch.get_num_threads() == 1)


def attend(q: torch.Tensor, pool, read: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
           scale: float) -> torch.Tensor | None:
    """The compiled kernel's [b, nH * D] for decode queries q [b, nH, D] (see `_attend`), or
    None when it cannot be compiled here (then the caller's eager path runs)."""
    global _compiled, _failed
    if _compiled is None:
        with _lock:
            if _compiled is None and not _failed:
                _compiled = torch.compile(_attend, dynamic=True)
    try:
        return _compiled(q, gather_rows(pool.k, read), gather_rows(pool.v, read), lo, hi, scale)
    except Exception as e:  # noqa: BLE001 - a missing toolchain must not take the peer down
        _failed = True
        log.warning("compiled decode attention unavailable (%s: %s); using the eager path", type(e).__name__, e)
        return None


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
