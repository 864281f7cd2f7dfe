"""A chat request's tools: validated, rendered into the prompt, and held to ``tool_choice``.

``tool_choice`` ``none`` leaves the tools out of the prompt; ``auto`` renders them and parses
whatever call the model writes in its family's format; ``required`` and a named function force a
call with a grammar (``client/grammar.py``): the model then writes the call as JSON,
``{"name": ..., "arguments": {...}}`` for ``required`` and the arguments alone for a named one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

from p2pserve.client.tools.formats import ToolCall, parse_tool_calls
from p2pserve.errors import BadRequestError

MAX_TOOLS = 128
ROLES = ("system", "user", "assistant", "tool")


@dataclass
class ToolRequest:
    """The tools of one request and how they are used (see the module docstring)."""

    tools: list = field(default_factory=list)  # the OpenAI tool objects, as the chat template takes them
    choice: str = "auto"  # "auto", "none", "required" or "named"
    name: Optional[str] = None  # the function a named choice forces

    @property
    def template_tools(self) -> Optional[list]:
        """What the chat template renders (None: no tools in the prompt)."""
        return self.tools if self.tools and self.choice != "none" else None

    @property
    def parses(self) -> bool:
        """Whether the reply is parsed for calls."""
        return bool(self.tools) and self.choice != "none"

    def schema(self) -> Optional[dict]:
        """The JSON schema a forced choice holds the reply to (None for auto and none)."""
        if self.choice == "named":
            return _parameters(next(t for t in self.tools if t["function"]["name"] == self.name))
        if self.choice == "required":
            return {"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                                 "arguments": _parameters(t)},
                               "required": ["name", "arguments"], "additionalProperties": False}
                              for t in self.tools]}
        return None

    def calls(self, text: str, fmt: Optional[str]) -> tuple[str, list[ToolCall]]:
        """(content, calls) of the reply's ``text`` (decoded with its special tokens)."""
        if not self.parses:
            return text, []
        if self.choice == "named":
            return "", [ToolCall(self.name, text.strip())]
        if self.choice == "required":
            try:
                obj = json.loads(text)
                return "", [ToolCall(obj["name"], json.dumps(obj["arguments"]))]
            except (ValueError, KeyError, TypeError):  # cut short by max_tokens: no call
                return text, []
        return parse_tool_calls(text, fmt)


def _parameters(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def parse_tools(tools, tool_choice) -> Optional[ToolRequest]:
    """The request's ``tools`` and ``tool_choice`` validated (None when it names no tools);
    raises ``BadRequestError`` naming what is wrong."""
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise BadRequestError("tool_choice needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise BadRequestError(f"tools must be a list of at most {MAX_TOOLS} function tools")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise BadRequestError(f"tools[{i}].function.parameters must be a JSON schema object")
        names.append(fn["name"])
    req = ToolRequest(tools=tools)
    if tool_choice in (None, "auto", "none", "required"):
        req.choice = tool_choice or "auto"
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict) \
            and tool_choice["function"].get("name") in names:
        req.choice, req.name = "named", tool_choice["function"]["name"]
    else:
        raise BadRequestError(f"tool_choice must be none, auto, required or a function of tools {names}")
    return req


def clean_messages(messages) -> list[dict]:
    """Chat messages as the chat template takes them: text content (content parts joined),
    ``developer`` as ``system``, assistant ``tool_calls`` with their arguments as objects, and
    ``tool`` results; raises ``BadRequestError`` naming the first bad message."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise BadRequestError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    return [_clean(i, m) for i, m in enumerate(messages)]


def _clean(i: int, m) -> dict:
    if not isinstance(m, dict):
        raise BadRequestError(f"messages[{i}] must be an object")
    role = "system" if m.get("role") == "developer" else m.get("role")
    if role not in ROLES:
        raise BadRequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {str(role)[:40]!r}")
    content = m.get("content")
    if isinstance(content, list):  # the content-parts form: keep the text parts
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
            raise BadRequestError(f"messages[{i}].content: only text parts are supported")
        content = "".join(parts)
    calls = m.get("tool_calls") if role == "assistant" else None
    if content is None and calls:
        content = ""
    if not isinstance(content, str):
        raise BadRequestError(f"messages[{i}].content must be a string")
    out = {"role": role, "content": content}
    if calls:
        out["tool_calls"] = [_call(i, c) for c in (calls if isinstance(calls, list) else [None])]
    if role == "tool" and isinstance(m.get("tool_call_id"), str):
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _call(i: int, c) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadRequestError(f"messages[{i}].tool_calls must be function calls with a name")
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        pass  # the template renders it as the text it is
    return {"id": c.get("id", ""), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def with_forced_call(params, request: Optional[ToolRequest]):
    """``params`` (``GenerationParams``) holding the reply to a forced choice's schema."""
    schema = request.schema() if request is not None else None
    if schema is None:
        return params
    return params.with_sampling(response_format={"type": "json_schema", "json_schema": {"schema": schema}})


def with_tool_calls(reply, request: Optional[ToolRequest], info):
    """``reply`` with ``tool_calls`` (and ``content``, the text without them) parsed in the
    format of ``info``'s chat template."""
    from p2pserve.client.tools.formats import detect_format

    reply.content, reply.tool_calls = reply.text, []
    if request is not None and request.parses:
        eos = set(info.eos_ids)
        text = info.tokenizer.decode([t for t in reply.tokens if t not in eos], skip_special_tokens=False)
        reply.content, reply.tool_calls = request.calls(text, detect_format(info.tokenizer.chat_template))
    return reply
