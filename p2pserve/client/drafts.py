"""Drafts for speculative decoding: what proposes the next k tokens at the client.

* :class:`PromptLookup` (``speculative="prompt-lookup"``) needs no model: it finds the latest
  earlier occurrence of the last n tokens of prompt + output and proposes the tokens that
  followed it. Replies that copy from their prompt (code edits, summaries, quotes) get long
  accepted runs; others get none, and the adaptive k stops drafting.
* :class:`DraftModel` (``speculative="draft:PATH"``) runs a small local ``transformers`` model that
  shares the target's tokenizer, greedily, keeping its own KV cache across steps.

Both propose deterministically (q is a point mass), which ``client/speculative.py`` explains.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Optional, Protocol, Sequence

from p2pserve.config import ClientConfig, SpeculativeConfig
from p2pserve.errors import ConfigError, UnknownModelError


class Drafter(Protocol):
    """Proposes up to k tokens to follow ``context`` (prompt and output so far)."""

    #: whether :meth:`propose` computes (run it off the event loop)
    blocking: bool

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """At most ``k`` token ids that might follow ``context``; [] for no guess."""

    def session(self) -> "Drafter":
        """A drafter for one generation (one owning its own state, where the drafter keeps any)."""


class PromptLookup:
    """Prompt-lookup (n-gram) drafting: copy what followed the last n tokens earlier on."""

    blocking = False

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1):
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def session(self) -> "PromptLookup":
        """Itself: prompt lookup keeps no state."""
        return self

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """The k tokens after the latest earlier occurrence of the longest matching suffix."""
        if k <= 0:
            return []
        ctx = list(context)
        for n in range(min(self.ngram_max, len(ctx) - 1), self.ngram_min - 1, -1):
            pattern = ctx[-n:]
            first = pattern[0]
            # latest start i < len - n with ctx[i:i + n] == pattern (the suffix itself excluded)
            for i in range(len(ctx) - n - 1, -1, -1):
                if ctx[i] == first and ctx[i:i + n] == pattern:
                    return ctx[i + n:i + n + k]
        return []


class DraftModel:
    """A small local causal LM sharing the target's tokenizer, proposing its greedy tokens.

    Its KV cache follows the context across steps: a proposal first crops it to the prefix it
    shares with the new context (rejected drafts leave it) and feeds only the rest. Each
    generation drafts on its own :meth:`session` (its own cache, the weights shared).
    """

    blocking = True

    def __init__(self, path: str | Path, vocab_size: int, tokenizer=None):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        folder = Path(path)
        if not (folder / "config.json").is_file():
            raise UnknownModelError(f"draft model {str(path)!r} is not a model folder (no config.json)")
        config = AutoConfig.from_pretrained(folder)
        if config.vocab_size != vocab_size:
            raise ConfigError(f"draft model {str(path)!r} has a vocabulary of {config.vocab_size} tokens, "
                              f"the target has {vocab_size}: a draft must share the target's tokenizer")
        _check_tokenizer(folder, tokenizer)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self._cache = None
        self._ids: list[int] = []  # the tokens self._cache holds
        # transformers 5.2x renamed ``past_key_values`` to ``cache`` (argument and output field)
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    def session(self) -> "DraftModel":
        """A drafter on the same weights with a cache of its own."""
        twin = object.__new__(DraftModel)
        twin.model, twin._cache, twin._ids, twin._cache_arg = self.model, None, [], self._cache_arg
        return twin

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """The draft model's k greedy tokens after ``context``."""
        import torch

        if k <= 0:
            return []
        ctx = list(context)
        keep = 0
        while keep < min(len(ctx) - 1, len(self._ids)) and ctx[keep] == self._ids[keep]:
            keep += 1
        if self._cache is not None and keep < len(self._ids):
            self._cache.crop(keep - len(self._ids))  # a negative count drops that many (transformers 4 and 5)
        self._ids = ctx[:keep]
        feed, out = ctx[keep:], []
        with torch.inference_mode():
            for _ in range(k):
                result = self.model(torch.tensor([feed]), use_cache=True, **{self._cache_arg: self._cache})
                self._cache = getattr(result, self._cache_arg)
                self._ids += feed
                token = int(result.logits[0, -1].argmax())
                out.append(token)
                feed = [token]
        return out


def _check_tokenizer(folder: Path, tokenizer) -> None:
    """Raise unless the draft folder's tokenizer (when it has one) maps tokens as ``tokenizer`` does."""
    if tokenizer is None or not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(folder)
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"draft model {str(folder)!r} has another tokenizer than the target: "
                          "a draft must share the target's tokenizer")


def check_speculative(spec: Optional[str]) -> None:
    """Raise ConfigError unless ``spec`` names a drafter :func:`make_drafter` knows (or off):
    ``ClientConfig.speculative``'s own check."""
    ClientConfig(speculative=spec)


def make_drafter(spec: Optional[str], vocab_size: int, tokenizer=None,
                 config: SpeculativeConfig = SpeculativeConfig()) -> Optional[Drafter]:
    """The drafter named by ``spec``: None (off), ``"prompt-lookup"`` or ``"draft:PATH"``."""
    check_speculative(spec)
    if spec in (None, "", "off"):
        return None
    if spec == "prompt-lookup":
        return PromptLookup(config.ngram_max, config.ngram_min)
    return DraftModel(spec[len("draft:"):], vocab_size, tokenizer)
