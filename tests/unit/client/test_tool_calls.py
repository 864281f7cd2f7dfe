"""Tool-call parsing (client/tools/) and the OpenAI fields beyond plain text (http/openai/extras.py)."""

from __future__ import annotations

import json

import pytest

from p2pserve.http.openai.extras import parse_extras, sampling_defaults, sampling_fields
from p2pserve.client.tools import ToolStream, detect_format, parse_tool_calls, parse_tools
from p2pserve.client.tools.requests import clean_messages
from p2pserve.errors import BadRequestError, HTTPError

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_the_three_formats_parse():
    content, calls = parse_tool_calls('Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "hermes")
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]
    _, calls = parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
                                "llama3")
    assert [c.name for c in calls] == ["f", "g"]
    text = ('<|channel|>analysis<|message|>thinking<|end|><|start|>assistant<|channel|>commentary to=functions.f '
            '<|constrain|>json<|message|>{"a": 1}<|call|>')
    assert [(c.name, c.arguments) for c in parse_tool_calls(text, "harmony")[1]] == [("f", '{"a": 1}')]
    assert parse_tool_calls("<|channel|>final<|message|>Hi<|return|>", "harmony") == ("Hi", [])
    assert parse_tool_calls("<tool_call>not json</tool_call>", "hermes")[1] == []
    assert parse_tool_calls("{not a call", "llama3") == ("{not a call", [])


def test_formats_are_detected_from_the_template():
    assert detect_format("... <tool_call> ...") == "hermes"
    assert detect_format("Environment: ipython") == "llama3"
    assert detect_format("<|channel|>") == "harmony"
    assert detect_format("{{ messages }}") is None


def test_stream_sends_content_until_a_call_starts():
    s = ToolStream(parse_tools([TOOL], "auto"), "hermes")
    assert s.feed("Hello <tool") == "Hello "  # a tag may be starting: held
    assert s.feed("_call>\n{") == ""
    content, calls = s.finish('Hello <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    assert content == "" and calls[0].name == "f"
    plain = ToolStream(parse_tools([TOOL], "auto"), "hermes")
    assert plain.feed("Just <b>text</b>") == "Just <b>text</b>"
    assert plain.finish("Just <b>text</b>") == ("", [])


def test_tool_choice_and_messages():
    assert parse_tools([TOOL], {"type": "function", "function": {"name": "f"}}).schema() == {"type": "object"}
    assert parse_tools([TOOL], "required").schema()["anyOf"][0]["properties"]["name"] == {"const": "f"}
    assert parse_tools([TOOL], "none").template_tools is None
    for tools, choice in [([TOOL], "sometimes"), ([{"type": "function"}], "auto"), (None, "required"),
                          ([TOOL], {"type": "function", "function": {"name": "g"}})]:
        with pytest.raises(BadRequestError):
            parse_tools(tools, choice)
    clean = clean_messages([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}])
    assert clean[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1} and clean[1]["role"] == "tool"


def test_openai_extra_fields():
    ex = parse_extras({"n": 3, "logprobs": 2, "echo": True}, "completion")
    assert (ex.n, ex.logprobs, ex.top_logprobs, ex.echo) == (3, True, 2, True)
    fields = sampling_fields({"logit_bias": {"5": -100}, "min_p": 0.1}, ex, {"repetition_penalty": 1.1})
    assert fields["logit_bias"] == {5: -100.0} and fields["repetition_penalty"] == 1.1 and fields["prompt_logprobs"]
    for body, kind in [({"n": 0}, "chat"), ({"n": 17}, "chat"), ({"top_logprobs": 2}, "chat"),
                       ({"logprobs": 21}, "completion"), ({"response_format": {"type": "yaml"}}, "chat")]:
        with pytest.raises(HTTPError):
            parse_extras(body, kind)
    with pytest.raises(HTTPError):
        sampling_fields({"logit_bias": {"x": 1}}, ex, {})


def test_sampling_defaults_come_from_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "eos_token_id": 2}))
    assert sampling_defaults(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.9}
    assert sampling_defaults(None) == {}
