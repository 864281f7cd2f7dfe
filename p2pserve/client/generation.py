"""The generation loop: token ids in, streamed text out, with EOS / stop strings / max tokens.

Works on anything with the ``InferenceSession`` interface (``position``, ``history``,
``rewind()``, ``step()``), so the failover wrapper plugs in unchanged. When a new prompt shares
a prefix with what the session already holds (the next chat turn), only the new tokens are sent
and the peers' caches are reused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator

from p2pserve.client.textstream import IncrementalDetokenizer, StopStringMatcher
from p2pserve.errors import BadRequestError


@dataclass(frozen=True)
class GenerationParams:
    """What the caller asks for one reply."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise BadRequestError for values no request may carry."""
        if self.max_new_tokens < 1:
            raise BadRequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature <= 100:
            raise BadRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise BadRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise BadRequestError(f"top_k must be >= 0, got {self.top_k}")


@dataclass
class GenerationEvent:
    """One generated token and the text it completed (possibly empty)."""

    token: int
    text: str


@dataclass
class GenerationResult:
    """A finished generation."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"  # "stop" (EOS or stop string) or "length"
    prompt_tokens: int = 0


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


async def stream_generate(
    session,
    prompt_ids: list[int],
    params: GenerationParams,
    eos_token_ids: set[int],
    tokenizer=None,
    result: GenerationResult | None = None,
) -> AsyncIterator[GenerationEvent]:
    """Generate after ``prompt_ids``, yielding each token with its newly final text.

    ``result`` (if given) is filled in as generation proceeds, including ``finish_reason``.
    """
    params.validate()
    if not prompt_ids:
        raise BadRequestError("the prompt is empty")
    result = result if result is not None else GenerationResult()
    result.prompt_tokens = len(prompt_ids)
    # Reuse the cache for the shared prefix; at least one token must be sent to get logits.
    keep = min(common_prefix(session.history, prompt_ids), len(prompt_ids) - 1)
    if keep < session.position:
        session.rewind(keep)
    pending = prompt_ids[keep:]
    detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
    stops = StopStringMatcher(tuple(params.stop))
    for _ in range(params.max_new_tokens):
        if session.position + len(pending) > session.max_length:
            result.finish_reason = "length"
            break
        token = await session.step(pending)
        pending = [token]
        result.tokens.append(token)
        if token in eos_token_ids and not params.ignore_eos:
            result.finish_reason = "stop"
            break
        text = stops.feed(detok.push(token)) if detok else ""
        result.text += text
        yield GenerationEvent(token, text)
        if stops.stopped:
            result.finish_reason = "stop"
            break
    else:
        result.finish_reason = "length"
    if detok is not None and not stops.stopped:
        tail = stops.feed(detok.flush()) + stops.flush()
        if tail:
            result.text += tail
            yield GenerationEvent(-1, tail)


async def generate(session, prompt_ids, params, eos_token_ids, tokenizer=None) -> GenerationResult:
    """Non-streaming convenience: run ``stream_generate`` to completion."""
    result = GenerationResult()
    async for _ in stream_generate(session, prompt_ids, params, eos_token_ids, tokenizer, result):
        pass
    return result


def eos_ids_of(tokenizer, generation_config=None) -> set[int]:
    """All token ids that end a reply: the tokenizer's EOS plus the model's generation EOS."""
    ids: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    return ids
