"""A stand-in swarm that answers every step at once, to measure what the client's per-token path
and the OpenAI server spend per token (``benchmarks/api_overhead.py``).

The real ``Generation``, ``ReplyStream``, detokenizer and HTTP server run; only the pipeline is
replaced. :class:`InstantPipeline` answers a step with the next token of a script without doing
any work, yielding to the event loop once every ``per_tick`` steps, as the replies of a real
pipeline arrive from the network (``per_tick`` > 1: several tokens ready in the same loop tick,
as when a ring or a speculative step delivers them together). It uses only what ``Generation``
has always read of a pipeline, so the benchmark can drive earlier versions of the client with it.
"""

from __future__ import annotations

import asyncio
from typing import Optional, Sequence, Union


class _NoForwarding:
    """A route that never pushes nor rings (``Pipeline.forwarding``)."""

    def limit_ring(self, limit) -> None:
        """Nothing to limit."""


class InstantPipeline:
    """A pipeline whose steps cost nothing: step ``i`` answers ``script[i % len(script)]``; with
    ``batch``, each step answers the next ``per_tick`` script tokens as one list instead, as a
    route that ran ahead of the client does (``Generation`` takes either)."""

    sampling = None
    trust = None
    last_reply = None

    def __init__(self, script: Sequence[int], max_length: int, vocab_size: int, per_tick: int = 1,
                 batch: bool = False):
        from p2pserve.client.hop import Hop

        self.script = list(script)
        self.max_length = max_length
        self.vocab_size = vocab_size
        self.per_tick = per_tick
        self.batch = batch
        self.history: list[int] = []
        self.forwarding = _NoForwarding()
        self.route = [Hop("instant", 0, 1)]
        self.route_log = [list(self.route)]
        self.failures: list = []
        self.steps = 0

    @property
    def position(self) -> int:
        """Tokens the (absent) peers hold."""
        return len(self.history)

    def rewind(self, position: int) -> None:
        """Forget the tokens from ``position`` on."""
        del self.history[position:]

    async def open(self) -> None:
        """Nothing to open."""

    async def close(self) -> None:
        """Nothing to close."""

    async def step(self, token_ids: Sequence[int], outputs: int = 1, allowed: Optional[bytes] = None,
                   prompt_logprobs: bool = False) -> Union[int, list[int]]:
        """The next script token after ``token_ids``; every ``per_tick``-th step waits one loop
        tick. With ``batch``: the next ``per_tick`` tokens, after one tick."""
        self.history.extend(token_ids)
        if self.batch:
            await asyncio.sleep(0)
            first, self.steps = self.steps, self.steps + self.per_tick
            return [self.script[i % len(self.script)] for i in range(first, self.steps)]
        self.steps += 1
        if self.steps % self.per_tick == 0:
            await asyncio.sleep(0)
        return self.script[(self.steps - 1) % len(self.script)]


class InstantClient:
    """An ``AsyncClient`` stand-in for the OpenAI server over :class:`InstantPipeline` routes: real
    tokenizer, chat template, generation loop and metrics; ``script`` is what every reply says."""

    def __init__(self, info, script: Sequence[int], per_tick: int = 1):
        from p2pserve.metrics import ClientMetrics

        self.info = info
        self.script = list(script)
        self.per_tick = per_tick
        self.metrics = ClientMetrics()

    @property
    def model_id(self) -> str:
        """The checkpoint's id."""
        return self.info.spec.model_id

    def chat_prompt(self, messages, tools=None) -> list[int]:
        """Token ids of ``messages`` through the chat template."""
        return self.info.chat_ids(messages, tools)

    def text_prompt(self, prompt) -> list[int]:
        """Token ids of a raw prompt (a string, or token ids used as is)."""
        if isinstance(prompt, list):
            return list(prompt)
        return list(self.info.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def generate_stream(self, prompt_ids, params=None, **kw):
        """A ``ReplyStream`` of a real ``Generation`` over a new :class:`InstantPipeline`."""
        from p2pserve.client.generation import Generation
        from p2pserve.client.reply import ReplyStream

        spec = self.info.spec
        pipeline = InstantPipeline(self.script, len(prompt_ids) + params.max_new_tokens, spec.vocab_size,
                                   self.per_tick)
        self.metrics.requests.inc()
        return ReplyStream(Generation(pipeline, list(prompt_ids), params, self.info.eos_ids, self.info.tokenizer,
                                      metrics=self.metrics))
