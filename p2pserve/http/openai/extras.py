"""The OpenAI API's fields beyond plain text: choices, log-probabilities, echo, tools,
``response_format``, the extra sampling fields, and the checkpoint's sampling defaults. Pure:
JSON in (validated, 400 naming the field), response parts out.

``n`` choices are separate generations of the same prompt (``openai_app`` starts the first,
and the others once its prompt is in the peers' caches, where prefix sharing lets them share
its KV blocks); with sampling, choice i draws with seed ``seed + i``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from p2pserve.client.tools import ToolRequest, detect_format, parse_tools
from p2pserve.errors import BadRequestError, HTTPError

MAX_N = 16  # choices per request
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024
#: generation_config.json fields applied where a request leaves them out (as vLLM does).
DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class Extras:
    """What a request asks beyond one plain text reply."""

    n: int = 1
    echo: bool = False  # completions: the prompt is part of the text (and of the log-probabilities)
    logprobs: bool = False  # each token's log-probability in the response
    top_logprobs: int = 0
    tools: Optional[ToolRequest] = None
    response_format: Optional[dict] = None
    token_ids: bool = False  # vLLM's return_tokens_as_token_ids: tokens named "token_id:<id>"


def sampling_defaults(model_path: Optional[str]) -> dict:
    """The sampling fields the checkpoint's ``generation_config.json`` sets (``DEFAULT_FIELDS``)."""
    try:
        config = json.loads((Path(model_path) / "generation_config.json").read_text())
    except (OSError, TypeError, ValueError):
        return {}
    if not isinstance(config, dict) or config.get("do_sample") is False:
        return {}
    return {k: config[k] for k in DEFAULT_FIELDS
            if isinstance(config.get(k), (int, float)) and not isinstance(config.get(k), bool)}


def _int(body: dict, name: str, default: int, low: int, high: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise HTTPError(400, f"'{name}' must be an integer in [{low}, {high}], got {str(value)[:40]}", param=name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise HTTPError(400, f"'{name}' must be a boolean", param=name)
    return value


def parse_extras(body: dict, kind: str) -> Extras:
    """The request's choices, log-probabilities, echo, tools and response format, validated."""
    ex = Extras(n=_int(body, "n", 1, 1, MAX_N), token_ids=_flag(body, "return_tokens_as_token_ids"))
    if kind == "chat":
        ex.logprobs = _flag(body, "logprobs")
        ex.top_logprobs = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
        if ex.top_logprobs and not ex.logprobs:
            raise HTTPError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        try:
            ex.tools = parse_tools(body.get("tools"), body.get("tool_choice"))
        except BadRequestError as e:
            raise HTTPError(400, e.message, param="tools") from None
    else:
        count = body.get("logprobs")
        ex.logprobs = count is not None
        ex.top_logprobs = _int(body, "logprobs", 0, 0, MAX_TOP_LOGPROBS)
        ex.echo = _flag(body, "echo")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema")):
        raise HTTPError(400, "'response_format' must be {'type': 'text' | 'json_object' | 'json_schema', ...}",
                        param="response_format")
    ex.response_format = fmt if fmt is not None and fmt.get("type") != "text" else None
    if ex.response_format is not None and ex.tools is not None and ex.tools.choice in ("required", "named"):
        raise HTTPError(400, "'response_format' and a forced 'tool_choice' exclude each other", param="response_format")
    return ex


def sampling_fields(body: dict, ex: Extras, defaults: dict) -> dict:
    """The ``GenerationParams`` keywords of the extra sampling fields (the checkpoint's
    ``defaults`` where the request leaves them out)."""
    out: dict = {}
    for name in ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = body.get(name, defaults.get(name))
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise HTTPError(400, f"'{name}' must be a number, got {str(value)[:40]}", param=name)
        out[name] = float(value)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            raise HTTPError(400, f"'logit_bias' must map up to {MAX_LOGIT_BIAS} token ids to numbers", param="logit_bias")
        try:
            out["logit_bias"] = {int(k): float(v) for k, v in bias.items() if not isinstance(v, bool)}
        except (TypeError, ValueError):
            raise HTTPError(400, "'logit_bias' keys must be token ids and values numbers", param="logit_bias") from None
        if len(out["logit_bias"]) != len(bias) or any(k < 0 for k in out["logit_bias"]):
            raise HTTPError(400, "'logit_bias' keys must be token ids and values numbers", param="logit_bias")
    out["logprobs"] = ex.logprobs
    out["top_logprobs"] = ex.top_logprobs
    out["prompt_logprobs"] = ex.echo and ex.logprobs
    return out


# ----------------------------------------------------------------------------- response parts


@dataclass
class Rendering:
    """What turns replies into response text: the tokenizer, the checkpoint's tool-call format
    (``tools.detect_format``) and its end-of-reply ids."""

    tokenizer: object = None
    tool_format: Optional[str] = None
    eos_ids: frozenset = frozenset()

    @classmethod
    def of(cls, client) -> "Rendering":
        """The rendering of an ``AsyncClient``'s checkpoint (empty for a stand-in without one)."""
        info = getattr(client, "info", None)
        tok = getattr(info, "tokenizer", None)
        if tok is None:
            return cls()
        return cls(tok, detect_format(getattr(tok, "chat_template", None)), frozenset(info.eos_ids))

    def full_text(self, reply) -> str:
        """The reply's text with its special tokens (where harmony marks its channels), without
        the end-of-reply token."""
        return self.tokenizer.decode([t for t in reply.tokens if t not in self.eos_ids], skip_special_tokens=False)

    def prompt_text(self, req) -> str:
        """A completion's prompt as text (echo)."""
        return req.prompt if isinstance(req.prompt, str) else self.tokenizer.decode(req.prompt_ids)


class TokenNames:
    """How tokens are named in log-probabilities: their text, or ``token_id:<id>`` (vLLM's
    ``return_tokens_as_token_ids``, for callers that need the exact ids)."""

    def __init__(self, tokenizer, ids: bool = False):
        self.tokenizer, self.ids = tokenizer, ids

    def text(self, token: int) -> str:
        """The name of ``token``."""
        return f"token_id:{token}" if self.ids else self.tokenizer.decode([token])

    def entry(self, token: int, logprob: float) -> dict:
        """A chat log-probability entry."""
        text = self.text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(names: TokenNames, entries) -> dict:
    """``choices[i].logprobs`` of a chat completion from ``TokenLogprob`` entries."""
    return {"content": [dict(names.entry(e.token, e.logprob), top_logprobs=[names.entry(t, v) for t, v in e.top])
                        for e in entries]}


def completion_logprobs(names: TokenNames, tokens: list[int], entries: list, offset: int = 0) -> dict:
    """``choices[i].logprobs`` of a (legacy) completion: ``tokens`` with one entry each (None
    for the prompt's first token, which has no log-probability), ``text_offset`` from ``offset``."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, e in zip(tokens, entries):
        text = names.text(token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        out["token_logprobs"].append(None if e is None else e.logprob)
        out["top_logprobs"].append(None if e is None else {names.text(t): v for t, v in e.top})
    return out
