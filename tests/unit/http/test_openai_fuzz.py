"""Fuzzing the OpenAI request parser: any bytes, any JSON value, any mix of the API's fields gives a
valid request or a 400-class ``HTTPError``, never another exception (a 500 at the HTTP edge).

``P2PSERVE_FUZZ_EXAMPLES`` sets the examples per test (default 2000).
"""

from __future__ import annotations

import json
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pserve.http.openai.schema import GenRequest, parse_request_body
from p2pserve.errors import HTTPError

EXAMPLES = int(os.environ.get("P2PSERVE_FUZZ_EXAMPLES", "2000"))
MODELS = {"m"}
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False, database=None,
                suppress_health_check=list(HealthCheck))

# JSON integers have no bound: 10**e up to 4000 digits (Python's int-from-text limit is 4300)
huge_ints = st.builds(lambda e, sign: sign * 10**e, st.integers(0, 4000), st.sampled_from([1, -1]))
scalars = (st.none() | st.booleans() | st.integers() | huge_ints
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                           | st.dictionaries(st.text(max_size=10), inner, max_size=5), max_leaves=20)

FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "n", "seed", "stop", "stream", "stream_options", "echo", "user"]
messages = st.lists(st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["system", "user", "assistant", "developer", "tool"]) | json_values,
    "content": st.text(max_size=30) | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text()}))
    | json_values,
}), max_size=4)
field_values = {
    "model": st.just("m") | json_values, "messages": messages | json_values,
    "prompt": st.text(max_size=30) | st.lists(st.integers(), max_size=5) | json_values,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=20) | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": json_values}) | json_values,
}
shallow = scalars | st.lists(scalars, max_size=3) | st.dictionaries(st.text(max_size=5), scalars, max_size=3)
requests = st.fixed_dictionaries({}, optional={f: field_values.get(f, shallow) for f in FIELDS})


def check(raw: bytes, kind: str) -> None:
    try:
        req = parse_request_body(raw, kind, MODELS, max_prompt_chars=100)
    except HTTPError as e:
        assert 400 <= e.status < 500 and e.message, e
        return
    assert isinstance(req, GenRequest) and req.kind == kind and req.model == "m"
    req.params.validate()  # what the parser let through, the client accepts


def encode(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


@FUZZ
@given(raw=st.binary(max_size=200), kind=st.sampled_from(["chat", "completion"]))
def test_any_bytes(raw, kind):
    check(raw, kind)


@FUZZ
@given(value=json_values, kind=st.sampled_from(["chat", "completion"]))
def test_any_json_value(value, kind):
    check(encode(value), kind)


@FUZZ
@given(body=requests, kind=st.sampled_from(["chat", "completion"]))
def test_any_mix_of_the_api_fields(body, kind):
    check(encode(body), kind)


@FUZZ
@given(field=st.sampled_from(FIELDS), value=scalars | json_values, kind=st.sampled_from(["chat", "completion"]))
def test_one_field_of_a_valid_request_replaced(field, value, kind):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", field: value}
    check(encode(body), kind)


@settings(FUZZ, max_examples=min(EXAMPLES, 100))  # each example is up to 400 kB of JSON
@given(depth=st.integers(min_value=1, max_value=100_000), opener=st.sampled_from(["[", '{"a":', '{"messages":[']))
def test_any_nesting_depth(depth, opener):
    check((opener * depth).encode(), "chat")
