"""Structured output: a reply held to a grammar (JSON, a JSON schema) by a token mask per step.

xgrammar (the library vLLM and SGLang use) compiles the grammar against the tokenizer once and
gives, for each position, the bitmask of the tokens that keep the text inside the grammar. The
client computes it and sends it to the last hop with the step (``Forward.allowed``), which
masks the logits before it samples (``peer/sampling.py``). Why the client and not the last peer:

* the mask is a function of the tokens so far, which the client holds: a replay after failover
  sends the same mask and gets the same token, and no peer keeps grammar state to lose;
* a peer needs no tokenizer and never compiles a grammar it was sent (a hostile schema can
  make compilation slow or large); the cost stays with whoever asked for it;
* per token it costs the client one ``fill_next_token_bitmask`` (measured in
  ``benchmarks/grammar_mask.py``) and the last hop ceil(V / 32) * 4 bytes on the wire (19 KiB at
  a 152k vocabulary) and one ``masked_fill``.

Compiled grammars are cached per tokenizer and grammar text, so a schema sent with every request
compiles once.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from typing import Optional, Sequence

from p2pserve.errors import BadRequestError, GenerationFailedError

#: Compiled grammars kept per tokenizer (a schema sent with every request compiles once).
CACHE_SIZE = 64
#: The largest grammar text (a JSON schema as JSON) compiled.
MAX_GRAMMAR_CHARS = 64 * 1024
_LOOSE_CHARACTER = r'[^\"\\\r\n]'
_JSON_CHARACTER = r'[^\0-\x1f\"\\\r\n]'


class GrammarState:
    """One reply's position in its grammar: the next token's mask, and the tokens taken so far."""

    def __init__(self, matcher, vocab_size: int):
        import xgrammar as xgr

        self._matcher = matcher
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # int32 [1, ceil(V / 32)]

    def mask(self) -> bytes:
        """The bitmask of the tokens the next one may be (``Forward.allowed``)."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return self._bitmask[0].numpy().astype("<i4").tobytes()

    def accept(self, token: int) -> None:
        """Advance past ``token``; a token the mask did not allow means the last hop ignored it."""
        if not self._matcher.accept_token(int(token)):
            raise GenerationFailedError(f"the last hop returned token {token}, which the grammar does not allow")

    @property
    def done(self) -> bool:
        """Whether the grammar is complete (only an end token may follow)."""
        return self._matcher.is_terminated()


class Grammar:
    """A compiled grammar; :meth:`matcher` starts a reply on it."""

    def __init__(self, compiled, vocab_size: int, text: str):
        self._compiled = compiled
        self.vocab_size = vocab_size
        self.text = text  # what was compiled (the JSON schema, or "json")

    def matcher(self, tokens: Sequence[int] = ()) -> GrammarState:
        """A fresh state, advanced past ``tokens`` (a reply rolled back to them)."""
        import xgrammar as xgr

        state = GrammarState(xgr.GrammarMatcher(self._compiled), self.vocab_size)
        for t in tokens:
            state.accept(t)
        return state

    def __repr__(self) -> str:
        return f"Grammar({self.text[:40]!r})"


class GrammarCompiler:
    """Compiles response formats for one tokenizer (thread-safe; compiled grammars cached)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int]):
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids))
        self._compiler = xgr.GrammarCompiler(info)
        self.vocab_size = vocab_size
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def json_schema(self, schema) -> Grammar:
        """The grammar of JSON text valid against ``schema`` (a dict), compact (no free whitespace)."""
        import xgrammar as xgr

        text = json.dumps(schema)  # key order kept: it is the order the properties are written in

        def compile_it():
            # xgrammar 0.2.9 writes a string with maxLength/minLength as characters [^"\\\r\n],
            # which lets control characters in (JSON forbids them raw); its plain strings exclude them
            ebnf = str(xgr.Grammar.from_json_schema(text, any_whitespace=False))
            return self._compiler.compile_grammar(ebnf.replace(_LOOSE_CHARACTER, _JSON_CHARACTER))

        return self._cached(text, compile_it)

    def json_object(self) -> Grammar:
        """The grammar of any JSON object (xgrammar's built-in JSON grammar takes any value)."""
        return self.json_schema({"type": "object"})

    def response_format(self, fmt) -> Optional[Grammar]:
        """The grammar of an OpenAI ``response_format``: None for ``text``; raises
        ``BadRequestError`` on anything else than ``json_object`` / ``json_schema``."""
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return self.json_object()
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise BadRequestError("response_format json_schema needs json_schema.schema, an object")
            return self.json_schema(schema)
        raise BadRequestError("response_format type must be text, json_object or json_schema")

    def _cached(self, text: str, compile_it) -> Grammar:
        if len(text) > MAX_GRAMMAR_CHARS:
            raise BadRequestError(f"the grammar has {len(text)} characters; at most {MAX_GRAMMAR_CHARS}")
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                return hit
        try:
            grammar = Grammar(compile_it(), self.vocab_size, text)
        except (RuntimeError, ValueError) as e:  # xgrammar's errors on a schema it cannot compile
            raise BadRequestError(f"the schema cannot be compiled to a grammar: {e}") from None
        with self._lock:
            self._cache[text] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar


_COMPILERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> its compiler
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> GrammarCompiler:
    """The one :class:`GrammarCompiler` of ``tokenizer`` (built on first use: building the
    tokenizer's token table takes a while on a large vocabulary)."""
    with _COMPILERS_LOCK:
        if tokenizer not in _COMPILERS:
            _COMPILERS[tokenizer] = GrammarCompiler(tokenizer, vocab_size, stop_ids)
        return _COMPILERS[tokenizer]


def grammar_of(params, tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> Optional[Grammar]:
    """The grammar a request's ``GenerationParams`` asks for: its compiled ``grammar``, else
    its ``response_format`` compiled now, else None."""
    if params.grammar is not None or params.response_format is None:
        return params.grammar
    return compiler_for(tokenizer, vocab_size, stop_ids).response_format(params.response_format)
