"""Next-token choice on the peer that holds the last layer.

Sampling is reproducible per position: the draw for the token at absolute position p uses a
generator seeded from (session seed, p). A client replaying a session after a failover, on
other peers, therefore samples exactly the tokens the original route would have.
"""

from __future__ import annotations

import torch

from p2pserve.errors import BadRequestError
from p2pserve.protocol import SamplingParams

_MASK64 = (1 << 63) - 1


def position_seed(seed: int, position: int) -> int:
    """Mix a session seed and a position into a 63-bit generator seed (SplitMix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK64


def sample_token(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Pick a token from fp32 logits [V] for absolute position ``position``.

    Raises :class:`BadRequestError` when the logits, or the probabilities at this temperature,
    are not finite: corrupt hidden states from upstream, or a temperature so small that the
    scaled logits overflow. The job fails; the compute thread does not.
    """
    if not bool(torch.isfinite(logits).all()):
        raise BadRequestError("the logits are not finite: the hidden states this span received were corrupt")
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        # Drop tokens once the mass before them already reaches top_p (keep at least one).
        drop = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= params.top_p
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scores, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        raise BadRequestError(f"temperature {params.temperature:g} makes the probabilities not finite")
    gen = torch.Generator().manual_seed(position_seed(params.seed, position))
    return int(torch.multinomial(probs, 1, generator=gen))


def sample_tokens(logits: torch.Tensor, params: SamplingParams, first_position: int) -> list[int]:
    """The token after each of several positions, from fp32 logits [m, V]: row i picks the token
    at absolute position ``first_position + i`` exactly as :func:`sample_token` would there.

    This is how a speculative step is verified (docs/speculative.md): the client accepts its
    draft tokens while they equal these, so the accepted tokens are the very tokens one-token
    steps would have produced, greedy or seeded.
    """
    return [sample_token(row, params, first_position + i) for i, row in enumerate(logits)]
