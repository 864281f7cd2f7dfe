"""Attention with sinks: one learned logit per head that takes part in the softmax but adds no value.

GPT-OSS gives every attention head a scalar ``sink``. Each query's softmax runs over its key
scores and that extra logit, and the sink's probability is then dropped, so a head can attend
to "nothing" (its outputs sum to less than one value). ``F.scaled_dot_product_attention`` has no
such term, so these layers compute attention as explicit matmuls, in the order transformers'
eager GPT-OSS attention (what `generate` runs for this family) uses: scores, mask, the sink
column, the max subtracted, softmax, the sink's column dropped, times V.

Shapes: b = sequences, nH / nKV = query / key-value heads, n = queries, c = keys, D = head dim.
"""

from __future__ import annotations

import torch


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """q [b, nH, n, D], k and v [b, nKV, c, D], ``mask`` bool broadcastable to [b, nH, n, c]
    (True: attend) or None, ``sinks`` [nH] -> [b, nH, n, D].

    A query row whose keys are all masked (padding in a batch) gets all its mass on the sink
    and a zero output, never NaN."""
    b, nH, n, _ = q.shape
    groups = nH // k.shape[1]
    if groups > 1:  # grouped-query heads: each KV head serves ``groups`` query heads in a row
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale  # [b, nH, n, c]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).reshape(1, nH, 1, 1).expand(b, nH, n, 1)
    logits = torch.cat((scores, sink), dim=-1)  # [b, nH, n, c + 1]
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)[..., :-1]  # the sink's share is dropped
    return torch.matmul(probs.to(v.dtype), v)
