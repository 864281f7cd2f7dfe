"""Next-token choice on the peer that holds the last layer.

Sampling is reproducible per position: the draw for the token at absolute position p uses a
generator seeded from (session seed, p). A client replaying a session after a failover, on
other peers, therefore samples exactly the tokens the original route would have. Everything
else that shapes the choice (logit bias, penalties over the session's token history, a grammar's
token mask) is a function of the session's ``SamplingParams`` and of what the client sent, so a
replay stays exact with it too.

Log-probabilities are those of the raw fp32 logits (``log_softmax``), before any of that shaping:
what a single process running the same weights reports for the same positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from p2pserve.errors import BadRequestError
from p2pserve.protocol import Logprobs, SamplingParams

_MASK64 = (1 << 63) - 1
_BITS = torch.arange(32, dtype=torch.int32)


def position_seed(seed: int, position: int) -> int:
    """Mix a session seed and a position into a 63-bit generator seed (SplitMix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK64


def mask_words(vocab_size: int) -> int:
    """int32 words of a token bitmask over ``vocab_size`` tokens (``Forward.allowed``)."""
    return -(-vocab_size // 32)


def allowed_tokens(allowed: bytes, vocab_size: int) -> torch.Tensor:
    """The bool [vocab_size] of a token bitmask (bit t of little-endian int32 word t // 32)."""
    words = torch.frombuffer(bytearray(allowed), dtype=torch.int32)  # [ceil(V / 32)]
    bits = (words.unsqueeze(1) >> _BITS) & 1  # [words, 32]
    return bits.reshape(-1)[:vocab_size].bool()


def shape_logits(logits: torch.Tensor, params: SamplingParams, history: Optional[Sequence[int]] = None,
                 allowed: Optional[bytes] = None) -> torch.Tensor:
    """fp32 logits [V] after logit bias, penalties over ``history`` (the token ids before the
    position being chosen) and the grammar mask ``allowed``; the input is not modified."""
    scores = logits.float()
    vocab = scores.shape[-1]
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias if t < vocab], dtype=torch.int64)
        bias = torch.tensor([b for t, b in params.logit_bias if t < vocab], dtype=torch.float32)
        scores = scores.index_add(0, ids, bias)
    if history is not None and params.needs_history:
        scores = _penalise(scores, params, history)
    if allowed is not None:
        keep = allowed_tokens(allowed, vocab)
        if not bool(keep.any()):
            raise BadRequestError("the token mask allows no token")
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def _penalise(scores: torch.Tensor, params: SamplingParams, history: Sequence[int]) -> torch.Tensor:
    vocab = scores.shape[-1]
    if params.repetition_penalty != 1.0 and len(history):
        seen = torch.tensor(sorted(set(history)), dtype=torch.int64)
        picked = scores[seen]
        scores = scores.clone()
        scores[seen] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    generated = history[params.penalty_start:]
    if (params.presence_penalty or params.frequency_penalty) and len(generated):
        counts = torch.bincount(torch.tensor(list(generated), dtype=torch.int64), minlength=vocab)[:vocab].float()
        scores = scores - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    return scores


def sample_token(logits: torch.Tensor, params: SamplingParams, position: int,
                 history: Optional[Sequence[int]] = None, allowed: Optional[bytes] = None) -> int:
    """Pick a token from fp32 logits [V] for absolute position ``position``.

    Raises :class:`BadRequestError` when the logits, or the probabilities at this temperature,
    are not finite: corrupt hidden states from upstream, or a temperature so small that the
    scaled logits overflow. The job fails; the compute thread does not.
    """
    if not bool(torch.isfinite(logits).all()):
        raise BadRequestError("the logits are not finite: the hidden states this span received were corrupt")
    if params.logit_bias or allowed is not None or (history is not None and params.needs_history):
        logits = shape_logits(logits, params, history, allowed)
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
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
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


def logprob_rows(logits: torch.Tensor, chosen: Sequence[int], k: int) -> Logprobs:
    """The packed log-probabilities of rows of fp32 logits [m, V]: each row's ``chosen`` token
    and its ``k`` most likely ones (fp32 ``log_softmax``, as one process computes it)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [m, V]
    ids = torch.tensor(list(chosen), dtype=torch.int64).reshape(-1, 1)
    picked = logp.gather(1, ids).reshape(-1)  # [m]
    top_ids, top_values = b"", b""
    if k:
        top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
        top_ids = top.indices.to(torch.int32).contiguous().numpy().astype("<i4").tobytes()
        top_values = top.values.contiguous().numpy().astype("<f4").tobytes()
        k = top.indices.shape[-1]
    return Logprobs(count=logp.shape[0], k=k, chosen=picked.numpy().astype("<f4").tobytes(),
                    top_ids=top_ids, top_values=top_values)


@dataclass
class Ask:
    """What a last-hop job asks beyond a plain sampled token: the session's token ``history``
    (all positions up to this Forward's end, when the client sends it), the grammar mask
    ``allowed`` for the next token, and whether its leading rows are prompt rows whose
    log-probabilities it wants (``Forward.prompt_logprobs``)."""

    history: Optional[list[int]] = None
    allowed: Optional[bytes] = None
    prompt_rows: int = 0

    def plain(self, params: SamplingParams) -> bool:
        """Whether the answer is just the token(s), chosen as without any of this."""
        return (not self.prompt_rows and self.allowed is None and not params.logprobs
                and (self.history is None or not params.needs_history))


@dataclass
class Choice:
    """A last hop's answer: the token(s) and the log-probabilities asked for."""

    tokens: list[int]
    logprobs: Optional[Logprobs] = None
    prompt_logprobs: Optional[Logprobs] = None


def choose(logits: torch.Tensor, params: SamplingParams, first_position: int, ask: Ask) -> Choice:
    """The answer from fp32 logits [m, V], row i being the one whose next token sits at
    ``first_position + i``: its first ``ask.prompt_rows`` rows score the history's tokens there
    (prompt log-probabilities); each later row picks a token as :func:`sample_token` does."""
    if not bool(torch.isfinite(logits).all()):
        raise BadRequestError("the logits are not finite: the hidden states this span received were corrupt")
    p = ask.prompt_rows
    history = ask.history
    prompt = None
    if p:
        prompt = logprob_rows(logits[:p], history[first_position:first_position + p], params.top_logprobs)
    tokens = []
    for i in range(p, logits.shape[0]):
        position = first_position + i
        before = history[:position] if history is not None else None
        tokens.append(sample_token(logits[i], params, position, before, ask.allowed))
    chosen = logprob_rows(logits[p:], tokens, params.top_logprobs) if params.logprobs else None
    return Choice(tokens, chosen, prompt)


def answer(chunks: list, rows: int, params: SamplingParams, position: int, ask: Optional[Ask]):
    """A last-hop job's answer from its logits ``chunks`` (each [r, V] or [V]), of which the last
    ``rows`` count, the last one's next token sitting at ``position``: the token (one row), the
    tokens (a speculative step's rows), or a :class:`Choice` when ``ask`` wants more."""
    logits = torch.cat([c.reshape(-1, c.shape[-1]) for c in chunks])[-rows:]  # [rows, V]
    first = position - rows + 1
    if ask is not None and not ask.plain(params):
        return choose(logits, params, first, ask)
    if rows > 1:
        return sample_tokens(logits, params, first)
    return sample_token(logits[0], params, position)
