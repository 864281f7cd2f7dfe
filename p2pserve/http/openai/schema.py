"""The OpenAI API's bodies, pure: requests in (validated), responses and errors out.

Every request parameter is validated once, by :class:`~p2pserve.client.params.GenerationParams`
(the same rules as the Python API); this module checks only what is the HTTP API's own: JSON
types, the OpenAI names (``max_tokens`` for ``max_new_tokens``), and limits of the OpenAI API
itself (``temperature`` <= 2, up to 16 stop strings, sizes that fit the wire); the fields beyond
plain text (``n``, log-probabilities, ``echo``, tools, ``response_format``, penalties) are parsed
and formatted by :mod:`p2pserve.http.openai.extras`.
Failures become :class:`~p2pserve.errors.HTTPError` with status 400 and the OpenAI field name.

:func:`parse_request_body` is the whole parser from raw bytes: any input gives a ``GenRequest``
or a 400 (malformed or deeply nested JSON included), never another exception. A prompt longer than
``max_prompt_chars`` is refused here, before anything tokenises it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from p2pserve.http.openai.extras import (
    Extras,
    Rendering,
    TokenNames,
    chat_logprobs,
    completion_logprobs,
    parse_extras,
    sampling_fields,
)
from p2pserve.client.params import GenerationParams
from p2pserve.client.tools.requests import clean_messages
from p2pserve.errors import (
    AllRoutesOverloadedError,
    BadRequestError,
    ConfigError,
    GenerationFailedError,
    HTTPError,
    NoRouteError,
    OverloadedError,
    P2PServeError,
    RoutingError,
)

DEFAULT_MAX_TOKENS = 256
SIZE_LIMIT = 1 << 20  # max_tokens and top_k: far beyond any model, small enough for the wire
OPENAI_MAX_TEMPERATURE = 2.0  # the OpenAI API's range; the Python API allows more
MAX_STOP_STRINGS = 16
SEED_LIMIT = 1 << 62
FLOAT_MAX = sys.float_info.max


def http_error_for(exc: BaseException) -> HTTPError:
    """Map a p2pserve exception to the HTTP status a client can act on."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, (BadRequestError, ConfigError)):
        msg = exc.message if isinstance(exc, BadRequestError) else str(exc)
        return HTTPError(400, msg)
    if isinstance(exc, (AllRoutesOverloadedError, OverloadedError)) or (
        isinstance(exc, NoRouteError) and exc.overloaded
    ):
        return HTTPError(429, f"every route is overloaded, retry later: {exc}", "rate_limit_error", code="overloaded")
    if isinstance(exc, RoutingError):
        return HTTPError(503, f"no route through the swarm: {exc}", "service_unavailable", code="no_route")
    if isinstance(exc, GenerationFailedError):
        return HTTPError(503, str(exc), "service_unavailable", code="generation_failed")
    if isinstance(exc, P2PServeError):
        return HTTPError(500, str(exc), "server_error")
    return HTTPError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


# ----------------------------------------------------------------------------- request parsing (pure)


@dataclass
class GenRequest:
    """What a chat or completion request asks for, validated."""

    kind: str  # "chat" or "completion"
    model: str
    params: GenerationParams
    messages: Optional[list] = None
    prompt: Any = None
    stream: bool = False
    include_usage: bool = False
    extras: Extras = field(default_factory=Extras)
    prompt_ids: Optional[list] = None  # set once tokenised (echo shows the prompt)


def _number(body: dict, name: str, default, integer: bool = False, at_most: Optional[float] = None):
    """``body[name]`` type-checked (and bounded by an API limit), or ``default`` when absent."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise HTTPError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, got {_shown(value)}",
                        param=name)
    # JSON integers are unbounded: 1 followed by 400 zeros is a number no float holds (NaN fails too)
    if not integer and not -FLOAT_MAX <= value <= FLOAT_MAX:
        raise HTTPError(400, f"'{name}' must be a finite number, got {_shown(value)}", param=name)
    if at_most is not None and value > at_most:
        raise HTTPError(400, f"'{name}' must be at most {at_most:g}, got {_shown(value)}", param=name)
    return value


def _shown(value) -> str:
    """``repr(value)`` cut short: an error message must not echo a megabyte of input back."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _stop(body: dict) -> Optional[list]:
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS):
        raise HTTPError(400, f"'stop' must be a string or a list of up to {MAX_STOP_STRINGS} non-empty strings",
                        param="stop")
    return stop


def _params(body: dict, extras: Extras, defaults: dict) -> GenerationParams:
    """The request's GenerationParams, validated by its own rules (OpenAI names in the errors);
    ``defaults`` are the checkpoint's sampling fields, for those the request leaves out."""
    limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    seed = _number(body, "seed", None, integer=True)
    if seed is not None and abs(seed) > SEED_LIMIT:
        raise HTTPError(400, f"'seed' must be in [-2^62, 2^62], got {_shown(seed)}", param="seed")
    if seed is not None and seed < 0:
        seed &= SEED_LIMIT - 1  # negative seeds are valid in the OpenAI API; ours are not
    params = GenerationParams.of(
        max_new_tokens=_number(body, limit_name, DEFAULT_MAX_TOKENS, integer=True, at_most=SIZE_LIMIT),
        temperature=float(_number(body, "temperature", defaults.get("temperature", 1.0), at_most=OPENAI_MAX_TEMPERATURE)),
        top_p=float(_number(body, "top_p", defaults.get("top_p", 1.0))),
        top_k=_number(body, "top_k", int(defaults.get("top_k", 0)), integer=True, at_most=SIZE_LIMIT),
        seed=seed, stop=_stop(body), **sampling_fields(body, extras, defaults),
    )
    problem = params.problem()
    if problem is not None:
        name = limit_name if problem.field == "max_new_tokens" else problem.field
        raise HTTPError(400, f"'{name}' {problem.message}", param=name)
    return params


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")  # Python's json reads NaN and Infinity; the API does not


def decode_json(raw: bytes) -> Any:
    """The JSON value of a request body, or a 400 saying why there is none."""
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except RecursionError:  # json recurses once per nesting level: a deep "[[[[..." ends here
        raise HTTPError(400, "the body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise HTTPError(400, f"the body is not valid JSON: {e}") from None


def parse_request_body(raw: bytes, kind: str, models: set[str], max_prompt_chars: Optional[int] = None,
                       defaults: Optional[dict] = None) -> GenRequest:
    """Validate the raw body of a ``kind`` ("chat" or "completion") request (``defaults``: the
    checkpoint's sampling fields, ``openai_extras.sampling_defaults``)."""
    parse = parse_chat_request if kind == "chat" else parse_completion_request
    return parse(decode_json(raw), models, max_prompt_chars, defaults)


def _check_prompt_size(size: int, max_prompt_chars: Optional[int], param: str, unit: str = "characters") -> None:
    if max_prompt_chars is not None and size > max_prompt_chars:
        raise HTTPError(400, f"the prompt has {size} {unit}; this server takes at most {max_prompt_chars}",
                        param=param, code="prompt_too_long")


def parse_common(body: dict, models: set[str], kind: str, defaults: Optional[dict] = None) -> GenRequest:
    """Fields shared by /v1/chat/completions and /v1/completions."""
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise HTTPError(400, "'model' is required (see GET /v1/models)", param="model")
    if model not in models:  # 404, as OpenAI and vLLM answer it
        raise HTTPError(404, f"unknown model {_shown(model)}; this server serves {sorted(models)}",
                        "invalid_request_error", param="model", code="model_not_found")
    extras = parse_extras(body, kind)
    params = _params(body, extras, defaults or {})
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise HTTPError(400, "'stream' must be a boolean", param="stream")
    opts = body.get("stream_options") or {}
    include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
    return GenRequest(kind=kind, model=model, params=params, stream=stream, include_usage=include_usage, extras=extras)


def parse_chat_request(body: dict, models: set[str], max_prompt_chars: Optional[int] = None,
                       defaults: Optional[dict] = None) -> GenRequest:
    """Validate a /v1/chat/completions body (its prompt size counts every role and content)."""
    req = parse_common(body, models, "chat", defaults)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "'messages' is required: a non-empty list of {role, content}", param="messages")
    try:
        clean = clean_messages(messages)
    except BadRequestError as e:
        raise HTTPError(400, e.message, param="messages") from None
    _check_prompt_size(sum(len(m["role"]) + len(m["content"]) + len(json.dumps(m.get("tool_calls", "")))
                           for m in clean), max_prompt_chars, "messages")
    req.messages = clean
    return req


def parse_completion_request(body: dict, models: set[str], max_prompt_chars: Optional[int] = None,
                             defaults: Optional[dict] = None) -> GenRequest:
    """Validate a /v1/completions body (prompt: a string, token ids, or a one-element list of either;
    its size is its characters, or its number of token ids)."""
    req = parse_common(body, models, "completion", defaults)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    ok = (isinstance(prompt, str) and prompt) or (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )
    if not ok:
        raise HTTPError(400, "'prompt' is required: a non-empty string or list of token ids (one prompt per request)",
                        param="prompt")
    _check_prompt_size(len(prompt), max_prompt_chars, "prompt", "characters" if isinstance(prompt, str) else "token ids")
    req.prompt = prompt
    return req


def usage(replies) -> dict:
    """OpenAI usage object of finished Replies (one per choice; the prompt counts once)."""
    replies = replies if isinstance(replies, list) else [replies]
    completion = sum(len(r.tokens) for r in replies)
    return {"prompt_tokens": replies[0].prompt_tokens, "completion_tokens": completion,
            "total_tokens": replies[0].prompt_tokens + completion}


def route_info(reply) -> dict:
    """A p2pserve extension field: the route(s) taken and timings."""
    return {
        "route": [{"peer_id": h.peer_id, "start": h.start, "end": h.end} for h in reply.route],
        "routes": len(reply.routes),
        "failures": reply.failures,
        "tokens_per_s": round(reply.tokens_per_s, 3),
        "time_to_first_token_s": None if reply.first_token_s is None else round(reply.first_token_s, 4),
    }


def choice_body(req: GenRequest, index: int, reply, rendering: Rendering) -> dict:
    """One choice of the non-streaming response: its text or message, tool calls and
    log-probabilities as the request asked."""
    ex, tok = req.extras, rendering.tokenizer
    if req.kind == "chat":
        content, calls = reply.text, []
        if ex.tools is not None and ex.tools.parses:
            content, calls = ex.tools.calls(rendering.full_text(reply), rendering.tool_format)
        message: dict = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        finish = "tool_calls" if calls and ex.tools.choice != "named" else reply.finish_reason
        return {"index": index, "message": message, "finish_reason": finish,
                "logprobs": chat_logprobs(TokenNames(tok, ex.token_ids), reply.logprobs) if ex.logprobs else None}
    text, logprobs = reply.text, None
    if ex.echo:
        text = rendering.prompt_text(req) + text
    if ex.logprobs:
        tokens, entries = list(reply.tokens), list(reply.logprobs)
        if ex.echo:
            tokens, entries = list(req.prompt_ids) + tokens, [None, *reply.prompt_logprobs] + entries
        logprobs = completion_logprobs(TokenNames(tok, ex.token_ids), tokens, entries)
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reply.finish_reason}


def completion_body(req: GenRequest, replies, rid: str, created: int, rendering: Rendering = Rendering()) -> dict:
    """The non-streaming response body (``replies``: a Reply per choice, or one Reply)."""
    replies = replies if isinstance(replies, list) else [replies]
    obj = "chat.completion" if req.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model,
            "choices": [choice_body(req, i, r, rendering) for i, r in enumerate(replies)],
            "usage": usage(replies), "p2pserve": route_info(replies[0])}


def chunk_body(req: GenRequest, rid: str, created: int, text: Optional[str] = None, role: bool = False,
               finish_reason: Optional[str] = None, index: int = 0, logprobs: Optional[dict] = None,
               tool_calls: Optional[list] = None) -> dict:
    """One streamed chunk of choice ``index``."""
    if req.kind == "chat":
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice]}
