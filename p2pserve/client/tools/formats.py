"""The tool-call formats of the families we serve, detected from the chat template and parsed
from the generated text (decoded with its special tokens, which harmony's markers are).

* ``hermes`` (Qwen, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block per call, free text before them;
* ``llama3`` (Llama 3.x): the answer is a JSON object ``{"name": ..., "parameters": {...}}``
  (several separated by ``;``), optionally after ``<|python_tag|>``;
* ``harmony`` (GPT-OSS): messages ``<|channel|>commentary to=functions.NAME <|constrain|>json
  <|message|>{...}<|call|>``; the ``final`` channel's message is the content, ``analysis`` is
  the model's reasoning and is left out.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Optional

FORMATS = ("hermes", "llama3", "harmony")


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: Optional[int] = None) -> dict:
        """The OpenAI ``tool_calls`` entry (with ``index``: a streamed delta's)."""
        entry = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return entry if index is None else {"index": index, **entry}


def detect_format(chat_template: Optional[str]) -> Optional[str]:
    """The tool-call format a chat template teaches its model, or None when it shows none."""
    t = chat_template or ""
    if "<|channel|>" in t:
        return "harmony"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3"
    return None


def _call_of(obj, args_key: str) -> Optional[ToolCall]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def _hermes(text: str) -> tuple[str, list[ToolCall]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for body in re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text[start:], re.S):
        try:
            call = _call_of(json.loads(body), "arguments")
        except ValueError:
            call = None
        if call is None:  # not a call after all: the whole text is content
            return text, []
        calls.append(call)
    return text[:start].rstrip(), calls


def _llama3(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    for part in (p for p in body.split(";") if p.strip()):
        try:
            call = _call_of(json.loads(part), "parameters")
        except ValueError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    return "", calls


_HARMONY = re.compile(r"<\|channel\|>(\w+)(.*?)<\|message\|>(.*?)(?=<\|end\|>|<\|call\|>|<\|return\|>|<\|start\|>|$)", re.S)


def _harmony(text: str) -> tuple[str, list[ToolCall]]:
    if "<|channel|>" not in text:
        return text, []
    content, calls = [], []
    for channel, header, body in _HARMONY.findall(text):
        to = re.search(r"to=functions\.([\w.-]+)", header)
        if to:
            calls.append(ToolCall(to.group(1), body.strip()))
        elif channel == "final":
            content.append(body)
    return "".join(content), calls


_PARSERS = {"hermes": _hermes, "llama3": _llama3, "harmony": _harmony}


def parse_tool_calls(text: str, fmt: Optional[str]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a reply's text in ``fmt``; the text itself and no call when ``fmt``
    is None or the text holds no well-formed call."""
    if fmt is None:
        return text, []
    return _PARSERS[fmt](text)
