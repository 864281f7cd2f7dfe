"""What a caller asks of one reply, validated in one place.

:class:`GenerationParams` is the one owner of request parameters: the Python API builds it from
keywords (:meth:`GenerationParams.of`), the OpenAI server from a JSON body, and
:meth:`GenerationParams.validate` turns it into the wire ``SamplingParams`` the last peer samples
with. The sampling ranges are the wire struct's own (``SamplingParams.validate``, which every
peer also applies to what it receives), so a client and a peer never disagree about them.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Optional

from p2pserve.errors import BadRequestError
from p2pserve.protocol import SamplingParams


@dataclass(frozen=True)
class Problem:
    """One invalid field of a request: which, and what is wrong with it."""

    field: str
    message: str  # what is wrong, without the field's name: "must be >= 1, got 0"


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
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False  # each generated token's log-probability (``Reply.logprobs``)
    top_logprobs: int = 0  # with that many alternatives
    prompt_logprobs: bool = False  # the prompt tokens' too (``Reply.prompt_logprobs``; the API's echo)
    grammar: object = None  # a ``client.grammar.Grammar`` the reply must follow (structured output)
    response_format: object = None  # or an OpenAI response_format ({"type": "json_schema", ...}) to compile

    @property
    def extras(self) -> bool:
        """Whether the last hop needs more than the plain token path: the history (penalties,
        prompt log-probabilities) or a grammar mask each step."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.prompt_logprobs or self.grammar is not None or self.response_format is not None)

    def with_sampling(self, **fields) -> "GenerationParams":
        """A copy with ``fields`` replaced (``dataclasses.replace``)."""
        return dataclasses.replace(self, **fields)

    @classmethod
    def of(cls, max_new_tokens=128, temperature=0.0, top_p=1.0, top_k=0, seed: Optional[int] = None, stop=None,
           ignore_eos: bool = False, **sampling) -> "GenerationParams":
        """From loosely typed keywords (the Python API's): one stop string or several, and
        ``seed=None`` for a random one when sampling (a fixed seed per request is what keeps a
        replay after failover exact). Not validated yet: see :meth:`validate`."""
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        if seed is None:
            seed = random.SystemRandom().getrandbits(62) if _positive(temperature) else 0
        bias = sampling.pop("logit_bias", None) or ()
        if isinstance(bias, dict):
            bias = tuple((int(t), float(b)) for t, b in bias.items())
        return cls(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                   stop=tuple(stop) if isinstance(stop, (list, tuple)) else stop, ignore_eos=ignore_eos,
                   logit_bias=tuple(bias), **sampling)

    def sampling(self) -> SamplingParams:
        """The wire struct of the sampling fields (unvalidated)."""
        return SamplingParams(temperature=float(self.temperature), top_k=int(self.top_k), top_p=float(self.top_p),
                              seed=int(self.seed), min_p=float(self.min_p),
                              repetition_penalty=float(self.repetition_penalty),
                              presence_penalty=float(self.presence_penalty),
                              frequency_penalty=float(self.frequency_penalty),
                              logit_bias=[(int(t), float(b)) for t, b in self.logit_bias],
                              logprobs=bool(self.logprobs or self.top_logprobs), top_logprobs=int(self.top_logprobs))

    def problem(self) -> Optional[Problem]:
        """The first invalid field, or None when every value is one a request may carry."""
        if not _integer(self.max_new_tokens):
            return Problem("max_new_tokens", f"must be an integer, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            return Problem("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            return Problem("stop", "must be a string or a list of non-empty strings")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not _number(getattr(self, name)):
                return Problem(name, f"must be a number, got {getattr(self, name)!r}")
        if not all(isinstance(p, tuple) and len(p) == 2 and _integer(p[0]) and _number(p[1]) for p in self.logit_bias):
            return Problem("logit_bias", "must map token ids to numbers")
        for name in ("top_k", "seed", "top_logprobs"):
            if not _integer(getattr(self, name)):
                return Problem(name, f"must be an integer, got {getattr(self, name)!r}")
        reason = self.sampling().validate()
        if reason is not None:
            # The wire struct words each reason "<field> <what is wrong>".
            name, _, message = reason.partition(" ")
            return Problem(name, message)
        return None

    def validate(self) -> SamplingParams:
        """The wire ``SamplingParams``; raises ``BadRequestError`` naming the first invalid field."""
        problem = self.problem()
        if problem is not None:
            raise BadRequestError(f"{problem.field} {problem.message}")
        return self.sampling()


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive(value) -> bool:
    return _number(value) and value > 0
