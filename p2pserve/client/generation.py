"""The generation loop: token ids in, streamed text out, with EOS / stop strings / max tokens.

:class:`Generation` drives a :class:`~p2pserve.client.pipeline.Pipeline` (or anything with its
``history``, ``position``, ``max_length``, ``rewind()`` and ``step()``) one token per iteration.
When a new prompt shares a prefix with what the pipeline already holds (the next chat turn),
only the new tokens are sent and the peers' caches are reused. Whoever made the pipeline closes
it: a generation never does, so a pipeline can carry several turns.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Optional

import msgspec

from p2pserve.client.grammar import grammar_of
from p2pserve.client.logprobs import unpack
from p2pserve.client.params import GenerationParams
from p2pserve.client.speculative import SpeculationTuner, accept
from p2pserve.config import SpeculativeConfig
from p2pserve.client.textstream import IncrementalDetokenizer, StopStringMatcher
from p2pserve.clock import Clock
from p2pserve.errors import BadRequestError
from p2pserve.protocol import MAX_VERIFY_OUTPUTS


@dataclass
class GenerationEvent:
    """One generated token and the text it completed (possibly empty); token -1 is the final flush."""

    token: int
    text: str


@dataclass
class GenerationResult:
    """A finished (or running) generation."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"  # "stop" (EOS or stop string) or "length"
    prompt_tokens: int = 0
    logprobs: list = field(default_factory=list)  # a TokenLogprob per token, when asked for
    prompt_logprobs: list = field(default_factory=list)  # a TokenLogprob per prompt token but the first


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def rollback_from(pipeline) -> Optional[int]:
    """The output position from which ``pipeline``'s tokens must be generated again (a peer that
    touched them was caught), or None (nothing verified, or nobody caught)."""
    return pipeline.trust.rollback_from() if pipeline.trust is not None else None


class Generation:
    """One reply being generated after ``prompt_ids``: an async iterator of :class:`GenerationEvent`.

    ``result`` fills in as it goes (``finish_reason`` once it ends); ``first_token_s`` and
    ``elapsed_s`` are seconds from construction to the first token and to the end.
    ``recompute_past`` is the model's `ModelSpec.recompute_past` (Phi-3's longrope switch): the
    step that takes the sequence past that length re-sends the whole history, so every peer
    recomputes its cache with the long-context rotary factors, as transformers' ``generate`` does.
    ``metrics`` (a ``ClientMetrics``) counts the tokens and times the first one.
    ``drafter`` (``client/drafts.py``) turns on speculative decoding: each step verifies up to
    k draft tokens, k chosen by ``tuner`` (``client/speculative.py``), and may yield several tokens.
    """

    def __init__(self, pipeline, prompt_ids: list[int], params: GenerationParams, eos_token_ids: set[int],
                 tokenizer=None, clock: Clock = time.perf_counter, recompute_past: Optional[int] = None,
                 metrics=None, drafter=None, speculative: SpeculativeConfig = SpeculativeConfig()):
        params.validate()
        if not prompt_ids:
            raise BadRequestError("the prompt is empty")
        self.pipeline = pipeline
        self.params = params
        sampling = getattr(pipeline, "sampling", None)
        if sampling is not None and sampling.needs_history and not pipeline.position:
            # presence and frequency penalties count the generated tokens only
            pipeline.sampling = msgspec.structs.replace(sampling, penalty_start=len(prompt_ids))
        self.eos_token_ids = eos_token_ids
        self.recompute_past = recompute_past
        self.result = GenerationResult(prompt_tokens=len(prompt_ids))
        self.first_token_s: Optional[float] = None
        self.elapsed_s = 0.0
        self._clock = clock
        self._metrics = metrics
        self._t0 = clock()
        self._prompt = list(prompt_ids)
        self._pending: Optional[list[int]] = None  # tokens the next step sends; None before the first
        self._detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._stops = StopStringMatcher(tuple(params.stop))
        self._done = False
        self._drafter = drafter
        self._stop_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)  # a ring's stop tokens
        self.tuner = SpeculationTuner(speculative) if drafter is not None else None
        self._ready: list[int] = []  # tokens a speculative step yielded that are not returned yet
        # the reply's grammar state (structured output, client/grammar.py): the next token's mask
        self._grammar = grammar_of(params, tokenizer, pipeline.vocab_size, eos_token_ids)
        self.grammar = self._grammar.matcher() if self._grammar is not None else None
        # the last hop gets each step's context and mask (client-driven): the pipeline was built
        # with ``extras`` for such parameters (``AsyncClient.generation``)
        self._extras = params.extras or params.logprobs or params.top_logprobs > 0
        self.rolled_back = 0  # tokens withdrawn because a peer that computed them was caught
        # whether a caught peer's tokens may be withdrawn and regenerated; a stream that has sent
        # them (ReplyStream) sets False: the route is only changed, what was sent stays
        self.withdraw = True

    def __aiter__(self) -> "Generation":
        return self

    async def __anext__(self) -> GenerationEvent:
        """The next token and its newly final text (the last event may flush held-back text)."""
        if self._done:
            raise StopAsyncIteration
        if self._pending is not None and rollback_from(self.pipeline) is not None:
            await self._roll_back()
        if self._ready and len(self.result.tokens) >= self.params.max_new_tokens:
            self._ready = []  # a batch that ran past the reply's end: the length check below ends it
        if self._ready:
            token = self._ready.pop(0)
        else:
            if self._pending is None:
                self._pending = self._resume()
            if (len(self.result.tokens) >= self.params.max_new_tokens
                    or self.pipeline.position + len(self._pending) > self.pipeline.max_length):
                if await self._recheck():
                    return await self.__anext__()
                return self._finish("length")
            if self.recompute_past is not None and 0 < self.pipeline.position <= self.recompute_past < (
                    self.pipeline.position + len(self._pending)):
                self._pending = self.pipeline.history + self._pending
                self.pipeline.rewind(0)
            self._limit_ring()
            if self._extras:
                token = await self._step_with_extras()
            elif self._drafter is None:
                token = self._first_of(await self.pipeline.step(self._pending))
            else:
                self._ready = await self._speculate()
                token = self._ready.pop(0)
            self._pending = [token] if not self._ready else [self._ready[-1]]
        self.result.tokens.append(token)
        if self._metrics is not None:
            self._metrics.tokens.inc()
        if self.first_token_s is None:
            self.first_token_s = self._clock() - self._t0
            if self._metrics is not None:
                self._metrics.first_token.observe(self.first_token_s)
        if token in self.eos_token_ids and not self.params.ignore_eos:
            if await self._recheck():
                return await self.__anext__()
            return self._finish("stop")
        text = self._stops.feed(self._detok.push(token)) if self._detok else ""
        self.result.text += text
        if self._stops.stopped:
            if await self._recheck():
                return await self.__anext__()
            self.result.finish_reason = "stop"
            self._done = True
            self.elapsed_s = self._clock() - self._t0
        return GenerationEvent(token, text)

    def _first_of(self, answer) -> int:
        """The first token of a step's answer. A step may answer several tokens that arrived
        together (a route that ran ahead of the client): the others wait in ``_ready`` and are
        yielded without awaiting, so a stream's reader finds them all in one loop tick and
        writes them at once; the last one is the next step's input, as after a speculative step."""
        if isinstance(answer, int):
            return answer
        self._ready = list(answer)
        return self._ready.pop(0)

    async def _step_with_extras(self) -> int:
        """A step whose last hop gets the grammar's mask or returns log-probabilities (and, on the
        first step, the prompt's); what it returned is kept in ``result``."""
        first = not self.result.tokens and not self.result.prompt_logprobs
        mask = self.grammar.mask() if self.grammar is not None else None
        want_prompt = first and self.params.prompt_logprobs and len(self._pending) > 1
        token = await self.pipeline.step(self._pending, 1, mask, want_prompt)
        reply = self.pipeline.last_reply
        if want_prompt:
            self.result.prompt_logprobs = unpack(reply.prompt_logprobs, self._pending[1:])
        if reply.logprobs is not None:
            self.result.logprobs.extend(unpack(reply.logprobs, [token]))
        if self.grammar is not None and token not in self.eos_token_ids:
            self.grammar.accept(token)
        return token

    def _limit_ring(self) -> None:
        """Tell a pipeline that may run a ring (``client/ring.py``) how far this generation can
        need it: the input position of its last token's step, and the tokens that end it; no ring
        at all with a drafter (speculative steps are plain pushes)."""
        remaining = self.params.max_new_tokens - len(self.result.tokens)  # tokens still to come, this one included
        self.pipeline.forwarding.limit_ring(None if self._drafter is not None else (
            self.pipeline.position + len(self._pending) + remaining - 2, self._stop_ids))

    async def _speculate(self) -> list[int]:
        """One speculative step: draft k tokens, verify them with the pending ones in one Forward,
        keep what :func:`accept` keeps, and rewind the peers past the rest; the tokens it yields."""
        pipeline, pending = self.pipeline, self._pending
        end = pipeline.position + len(pending)
        room = min(self.params.max_new_tokens - len(self.result.tokens) - 1, pipeline.max_length - end,
                   MAX_VERIFY_OUTPUTS - 1)
        if self.recompute_past is not None and end <= self.recompute_past:
            room = min(room, self.recompute_past - end)  # one Forward never crosses the rotary switch
        k = self.tuner.next_k(room)
        draft: list[int] = []
        if k > 0:
            context = pipeline.history + pending
            propose = self._drafter.propose
            draft = (await asyncio.to_thread(propose, context, k) if self._drafter.blocking
                     else propose(context, k))[:k]
        failures, t0 = len(pipeline.failures), self._clock()
        if draft:
            tokens = accept(draft, await pipeline.verify(pending + draft, len(draft) + 1))
            rejected = len(draft) + 1 - len(tokens)
            if rejected:  # the next step's position drops them from every peer's cache
                pipeline.rewind(pipeline.position - rejected)
        else:
            tokens = [await pipeline.step(pending)]
        plain = len(pending) == 1 and len(pipeline.failures) == failures  # a decode step, no replay
        self.tuner.observe(len(draft), len(tokens) - 1, self._clock() - t0 if plain else None)
        return tokens

    async def _recheck(self) -> bool:
        """Before the reply completes: with ``ClientConfig.verify_hold``, wait for the checks drawn
        on its steps; then, if a peer it used was caught, roll back (True: generation goes on)."""
        pipeline = self.pipeline
        if pipeline.trust is None:
            return False
        if pipeline.config.verify_hold and self.withdraw:  # a stream could not take its tokens back
            await pipeline.close()  # its due checks start
            if pipeline.trust is not None:
                await pipeline.trust.settle()
        return await self._roll_back()

    async def _roll_back(self) -> bool:
        """Withdraw every token from the first one a caught peer touched, and generate them again
        on a route without it (``client/trust/rollback.py``); False when nothing is suspect.

        Tokens already yielded are withdrawn from ``result`` (``rolled_back`` counts them); with
        ``withdraw`` off (a stream sent them) they stay and only the route changes (False).
        """
        pipeline = self.pipeline
        first = rollback_from(pipeline)
        if first is None:
            return False
        pipeline.trust.forget_caught()
        await pipeline.close()  # the caught peer may be on the route: the next step re-routes and replays
        if not self.withdraw:
            return False
        keep = min(max(0, first - len(self._prompt)), len(self.result.tokens))
        kept = self._prompt + self.result.tokens[:keep]
        pipeline.rewind(len(kept) - 1)
        self._pending, self._ready = [kept[-1]], []
        self.rolled_back += len(self.result.tokens) - keep
        del self.result.tokens[keep:]
        del self.result.logprobs[keep:]
        if self.grammar is not None:
            self.grammar = self._grammar.matcher(self.result.tokens)
        self.result.finish_reason = "length"
        if self._detok is not None:  # the text is the kept tokens' text again
            self._detok = IncrementalDetokenizer(self._detok.tokenizer)
            self._stops = StopStringMatcher(tuple(self.params.stop))
            self.result.text = "".join(self._stops.feed(self._detok.push(t)) for t in self.result.tokens)
        return True

    def _resume(self) -> list[int]:
        """Reuse the pipeline's cache for the shared prefix; the tokens the first step must send.

        At least one token is sent, to get logits back.
        """
        keep = min(common_prefix(self.pipeline.history, self._prompt), len(self._prompt) - 1)
        if keep < self.pipeline.position:
            self.pipeline.rewind(keep)
        return self._prompt[keep:]

    def _finish(self, reason: str) -> GenerationEvent:
        """End with ``reason``: returns the held-back text as a last event, or stops."""
        self.result.finish_reason = reason
        self._done = True
        self.elapsed_s = self._clock() - self._t0
        tail = ""
        if self._detok is not None:
            tail = self._stops.feed(self._detok.flush()) + self._stops.flush()
        if not tail:
            raise StopAsyncIteration
        self.result.text += tail
        return GenerationEvent(-1, tail)


async def generate(pipeline, prompt_ids: list[int], params: GenerationParams, eos_token_ids: set[int],
                   tokenizer=None, recompute_past: Optional[int] = None, drafter=None) -> GenerationResult:
    """Non-streaming convenience: run a :class:`Generation` to completion."""
    gen = Generation(pipeline, prompt_ids, params, eos_token_ids, tokenizer, recompute_past=recompute_past,
                     drafter=drafter)
    async for _ in gen:
        pass
    return gen.result


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
