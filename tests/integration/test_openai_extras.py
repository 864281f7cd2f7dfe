"""The official ``openai`` client and LangChain against ``p2pserve api`` over three real peers:
log-probabilities (sampled, top alternatives, and the prompt's through ``echo``) equal a
single-process fp32 log-softmax of the same weights within 1e-4, ``n`` choices, structured
output that validates against its JSON schema on every sampled request, the extra sampling
fields, and tool calls parsed in each of the three formats (tiny models whose weights answer with
a call: ``p2pserve.testing.tool_models``), streamed as deltas too.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from p2pserve.client.model_info import LocalModelInfo
from p2pserve.testing.tool_models import CALL_ARGUMENTS, CALL_NAME, TOOL_FORMATS, build_tool_model
from tests.harness import _reference_model, start_peers
from tests.integration.test_openai_api import KEY, oai, start_api

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.integration

TOL = 1e-4
MESSAGES = [{"role": "user", "content": "What is a peer-to-peer network?"}]
WEATHER = {"type": "function", "function": {
    "name": CALL_NAME, "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z ]{1,8}$"}, "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "ok", "n"], "additionalProperties": False}


SWARM: dict[str, list] = {}  # model path -> its peers as p2pserve.Client takes them


def _serve(path: str, ranges):
    peers = start_peers(path, ranges)
    SWARM[path] = [(p.maddrs[0], *p.layers) for p in peers]
    server = None
    try:
        server, url = start_api(path, [(p, *p.layers) for p in peers], "--served-model-name", "tiny")
        return url, peers, server
    except BaseException:
        for p in peers:
            p.stop()
        raise


@pytest.fixture(scope="module")
def api(model_dir):
    """(url, model path, LocalModelInfo) of `p2pserve api` over three tiny-Llama peers."""
    path = model_dir("llama")
    url, peers, server = _serve(path, [(0, 3), (3, 6), (6, 8)])
    try:
        yield url, path, LocalModelInfo.load(path)
    finally:
        server.stop()
        for p in peers:
            p.stop()


def reference_logprobs(path: str, ids: list[int]) -> torch.Tensor:
    """fp32 log-softmax [len(ids), V] of one process running the whole model on ``ids``."""
    with torch.no_grad():
        logits = _reference_model(path)(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_chat_logprobs_and_n_choices_match_one_process(api):
    url, path, info = api
    out = oai(url).chat.completions.create(model="tiny", messages=MESSAGES, n=4, max_tokens=8, temperature=1.0,
                                           seed=11, logprobs=True, top_logprobs=5,
                                           extra_body={"return_tokens_as_token_ids": True})
    assert len(out.choices) == 4 and [c.index for c in out.choices] == [0, 1, 2, 3]
    prompt = info.chat_ids(MESSAGES)
    assert out.usage.prompt_tokens == len(prompt)
    texts = set()
    for choice in out.choices:
        entries = choice.logprobs.content
        ids = [int(e.token.removeprefix("token_id:")) for e in entries]
        ref = reference_logprobs(path, prompt + ids)
        for i, e in enumerate(entries):
            row = ref[len(prompt) - 1 + i]
            assert abs(row[ids[i]].item() - e.logprob) < TOL
            top = torch.topk(row, 5)
            assert [abs(a - b.logprob) < TOL for a, b in zip(top.values.tolist(), e.top_logprobs)] == [True] * 5
            assert [f"token_id:{t}" for t in top.indices.tolist()] == [b.token for b in e.top_logprobs]
        texts.add(choice.message.content)
    assert len(texts) > 1  # seeds differ per choice


def test_completion_echo_logprobs_score_the_prompt(api):
    """What lm-evaluation-harness asks for a log-likelihood: echo + logprobs over token ids."""
    url, path, info = api
    prompt = info.tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]
    out = oai(url).completions.create(model="tiny", prompt=[prompt], max_tokens=1, temperature=0, echo=True,
                                      logprobs=1)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(prompt) + 1 and lp.token_logprobs[0] is None
    ref = reference_logprobs(path, prompt)
    for i in range(1, len(prompt)):
        assert abs(ref[i - 1, prompt[i]].item() - lp.token_logprobs[i]) < TOL
        assert abs(max(lp.top_logprobs[i].values()) - ref[i - 1].max().item()) < TOL
    assert out.choices[0].text.startswith(info.tokenizer.decode(prompt))


def test_json_schema_holds_on_every_sampled_request(api):
    url, _, _ = api
    client = oai(url)
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}

    def one(seed: int) -> str:
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=64, temperature=1.0,
                                             seed=seed, response_format=fmt)
        return out.choices[0].message.content

    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(one, range(50)))
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    # greedy (the checkpoint's defaults would sample with a random seed), and room to close the
    # object: a reply cut at max_tokens is a JSON prefix, as OpenAI's is
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=256, temperature=0.0,
                                         response_format={"type": "json_object"}).choices[0]
    assert out.finish_reason == "stop", out
    assert isinstance(json.loads(out.message.content), dict)


def test_logit_bias_penalties_and_model_errors(api):
    url, _, info = api
    client = oai(url)
    token = info.tokenizer.encode("fox", add_special_tokens=False)[0]
    out = client.completions.create(model="tiny", prompt="The quick", max_tokens=5, temperature=0,
                                    logit_bias={str(token): 100})
    assert out.choices[0].text == info.tokenizer.decode([token] * 5)
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0.7, seed=5, presence_penalty=1.5,
              frequency_penalty=1.0, extra_body={"repetition_penalty": 1.3, "min_p": 0.05})
    first = client.chat.completions.create(**kw).choices[0].message.content
    assert client.chat.completions.create(**kw).choices[0].message.content == first  # seeded: reproducible
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=MESSAGES)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=MESSAGES, presence_penalty=3)
    models = client.models.list().data
    assert all("sampling_defaults" in m.model_extra["p2pserve"] for m in models)


@pytest.fixture(scope="module", params=TOOL_FORMATS)
def tool_api(request, tmp_path_factory):
    """(url, format) of `p2pserve api` over two peers of the tiny model answering in that format."""
    path = str(build_tool_model(request.param, tmp_path_factory.mktemp(f"tool-{request.param}")))
    url, peers, server = _serve(path, [(0, 2), (2, 4)])
    try:
        yield url, request.param
    finally:
        server.stop()
        for p in peers:
            p.stop()


def test_tool_call_in_each_format(tool_api):
    url, fmt = tool_api
    client = oai(url)
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                         tools=[WEATHER], max_tokens=32, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", (fmt, choice)
    call = choice.message.tool_calls[0]
    assert call.function.name == CALL_NAME and json.loads(call.function.arguments) == CALL_ARGUMENTS
    # streamed: the same call as deltas
    calls = {}
    for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Paris?"}],
                                                tools=[WEATHER], max_tokens=32, temperature=0, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            calls.setdefault(d.index, [d.function.name, ""])[1] += d.function.arguments or ""
    assert [(n, json.loads(a)) for n, a in calls.values()] == [(CALL_NAME, CALL_ARGUMENTS)]
    # the call and its result go back into the conversation; tool_choice none answers in text
    history = [{"role": "user", "content": "Weather in Paris?"}, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    again = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], tool_choice="none",
                                           max_tokens=4, temperature=0)
    assert again.choices[0].message.tool_calls is None
    # forced: a named function's arguments follow its schema, whatever the model would say
    forced = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            tools=[WEATHER], max_tokens=32, temperature=1.0, seed=1,
                                            tool_choice={"type": "function", "function": {"name": CALL_NAME}})
    args = json.loads(forced.choices[0].message.tool_calls[0].function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])


def test_langchain_bound_tool_gets_its_call(tool_api):
    url, fmt = tool_api
    if fmt != "hermes":
        pytest.skip("one format is enough for LangChain")
    lc = pytest.importorskip("langchain_openai")
    model = lc.ChatOpenAI(base_url=url + "/v1", api_key=KEY, model="tiny", temperature=0, max_tokens=32)
    message = model.bind_tools([WEATHER]).invoke("What is the weather in Paris?")
    assert message.tool_calls[0]["name"] == CALL_NAME and message.tool_calls[0]["args"] == CALL_ARGUMENTS


def test_python_client_offers_the_same(api, tmp_path_factory):
    """``p2pserve.Client``: log-probabilities, n choices, a schema, and (on a tool model) tools."""
    import p2pserve

    url, path, info = api
    with p2pserve.Client(peers=SWARM[path], model=path, seed=1) as client:
        replies = client.chat(MESSAGES, max_new_tokens=6, temperature=1.0, seed=4, n=3, logprobs=True)
        assert len(replies) == 3 and len({r.text for r in replies}) > 1
        ref = reference_logprobs(path, info.chat_ids(MESSAGES) + replies[0].tokens)
        start = len(info.chat_ids(MESSAGES)) - 1
        assert max(abs(ref[start + i, e.token].item() - e.logprob) for i, e in enumerate(replies[0].logprobs)) < TOL
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
        jsonschema.validate(json.loads(client.chat(MESSAGES, max_new_tokens=64, temperature=1.0, seed=2,
                                                   response_format=fmt)), SCHEMA)
        forced = client.chat(MESSAGES, max_new_tokens=64, tools=[WEATHER], tool_choice="required")
        assert forced.tool_calls[0].name == CALL_NAME
