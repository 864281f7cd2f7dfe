"""The official ``openai`` package against ``p2pserve api`` on fixed chains of real peers.

Two tiny-Llama peers ([0:4), [4:8)) and a ``p2pserve api --api-key ... --peers ...`` process.
Greedy replies, streamed and not, must equal single-process transformers ``generate`` (cut at
the first EOS, where the server stops); a request without the key is refused; bad requests must
get a 400 with a message that says what is wrong. A second API over one peer with a tiny KV
budget answers 429 while another client's session fills that budget, and 503 once the peer is gone.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from p2pserve.client.model_info import LocalModelInfo
from p2pserve.launch import Child
from tests.harness import reference_generate, start_peers

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.integration

MAX_TOKENS = 12
KEY = "sk-p2pserve-integration"


def start_api(path: str, peers, *extra: str) -> tuple[Child, str]:
    """A ``p2pserve api`` process over ``peers`` (``(peer, start, end)`` each); returns it and its url."""
    spec = [f"{p.maddrs[0]}@{a}:{b}" for p, a, b in peers]
    child = Child.spawn("api", ["api", "--port", "0", "--model", path, "--api-key", KEY, *extra, "--peers", *spec])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready = [line for line in list(child.lines) if line.startswith("P2PSERVE_API_READY")]
        if ready:
            return child, dict(p.split("=", 1) for p in ready[0].split()[1:])["url"]
        if not child.alive:
            break
        time.sleep(0.05)
    child.stop()
    raise RuntimeError("api server did not start:\n" + child.output())


@pytest.fixture(scope="module")
def api(model_dir):
    """(base url, model path, LocalModelInfo, peers) of a running `p2pserve api` over two peers."""
    path = model_dir("llama")
    peers = start_peers(path, [(0, 4), (4, 8)])
    server = None
    try:
        server, url = start_api(path, [(p, *p.layers) for p in peers], "--served-model-name", "tiny")
        yield url, path, LocalModelInfo.load(path), peers
    finally:
        if server is not None:
            server.stop()
        for p in peers:
            p.stop()


def expected_text(info, path, prompt_ids) -> tuple[str, str]:
    """Greedy reference text, cut at the first EOS, and the finish reason the server should give."""
    ref = reference_generate(path, prompt_ids, MAX_TOKENS)
    cut = next((i for i, t in enumerate(ref) if t in info.eos_ids), None)
    tokens = ref if cut is None else ref[:cut]
    return info.tokenizer.decode(tokens, skip_special_tokens=True), ("length" if cut is None else "stop")


MESSAGES = [{"role": "user", "content": "What is a peer-to-peer network?"}]


def oai(url, key=KEY, retries=0):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=retries, timeout=120)


def test_models_lists_the_served_names(api):
    url, _, info, _ = api
    ids = {m.id for m in oai(url).models.list().data}
    assert ids == {info.spec.model_id, "tiny"}


def test_chat_completion_non_streamed_equals_generate(api):
    url, path, info, _ = api
    text, finish = expected_text(info, path, info.chat_ids(MESSAGES))
    r = oai(url).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == finish
    assert r.usage.prompt_tokens == len(info.chat_ids(MESSAGES))
    assert r.model == "tiny" and r.object == "chat.completion"


def test_chat_completion_streamed_equals_generate(api):
    url, path, info, _ = api
    text, finish = expected_text(info, path, info.chat_ids(MESSAGES))
    stream = oai(url).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
    pieces, finishes, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert "".join(pieces) == text
    assert finishes == [finish]
    assert usage is not None and usage.prompt_tokens == len(info.chat_ids(MESSAGES))


def test_completions_streamed_and_not(api):
    url, path, info, _ = api
    prompt = "Once upon a time"
    ids = list(info.tokenizer(prompt)["input_ids"])
    text, finish = expected_text(info, path, ids)
    c = oai(url)
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == text and r.choices[0].finish_reason == finish
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True) if ch.choices)
    assert streamed == text
    r2 = c.completions.create(model="tiny", prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert r2.choices[0].text == text


def test_seeded_sampling_is_reproducible(api):
    url, _, _, _ = api
    c = oai(url)
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0.8, seed=42)
    assert c.chat.completions.create(**kw).choices[0].message.content == \
        c.chat.completions.create(**kw).choices[0].message.content


def test_without_the_key_requests_are_refused(api):
    url, _, _, _ = api
    for key in ("sk-wrong", KEY + "x"):
        with pytest.raises(openai.AuthenticationError) as e:
            oai(url, key=key).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        oai(url, key="sk-wrong").models.list()
    with urllib.request.urlopen(url + "/health", timeout=60) as r:  # for load balancers, no key
        assert r.status == 200


def raw_post(url, path, body: bytes):
    req = urllib.request.Request(url + path, data=body, headers={"Content-Type": "application/json",
                                                                 "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_requests_get_400_with_a_clear_message(api):
    url, _, _, _ = api
    c = oai(url)
    cases = {
        "negative max tokens": (dict(model="tiny", messages=MESSAGES, max_tokens=-5), "max_tokens"),
        "oversized prompt": (dict(model="tiny", messages=[{"role": "user", "content": "word " * 6000}]), "tokens"),
        "empty messages": (dict(model="tiny", messages=[]), "messages"),
        "bad role": (dict(model="tiny", messages=[{"role": "wizard", "content": "hi"}]), "role"),
        "temperature": (dict(model="tiny", messages=MESSAGES, temperature=7), "temperature"),
    }
    for name, (kw, needle) in cases.items():
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**kw)
        assert e.value.status_code == 400, name
        assert needle in e.value.message, (name, e.value.message)
    with pytest.raises(openai.NotFoundError) as e:  # 404 model_not_found, as OpenAI answers it
        c.chat.completions.create(model="gpt-17", messages=MESSAGES)
    assert e.value.code == "model_not_found" and "unknown model 'gpt-17'" in e.value.message
    # the same through a streamed request: still a 400 before any event
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=0, stream=True)
    status, body = raw_post(url, "/v1/chat/completions", json.dumps({"model": "tiny"}).encode())
    assert status == 400 and "'messages' is required" in body["error"]["message"]
    status, body = raw_post(url, "/v1/chat/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = raw_post(url, "/v1/completions", json.dumps({"model": "tiny"}).encode())
    assert status == 400 and "'prompt' is required" in body["error"]["message"]


def test_python_sync_client_chat_stream_and_generate(api):
    """``p2pserve.Client`` (blocking, background loop) on the same peers, no HTTP in between."""
    import p2pserve

    _, path, info, peers = api
    text, finish = expected_text(info, path, info.chat_ids(MESSAGES))
    with p2pserve.Client(peers=[(p.maddrs[0], *p.layers) for p in peers], model=path, seed=3) as client:
        reply = client.chat(MESSAGES, max_new_tokens=MAX_TOKENS)
        assert reply == text and reply.finish_reason == finish
        assert [(h.start, h.end) for h in reply.route] == [(0, 4), (4, 8)]
        stream = client.chat_stream(MESSAGES, max_new_tokens=MAX_TOKENS)
        assert "".join(stream) == text and stream.reply.tokens == reply.tokens
        ids = info.chat_ids(MESSAGES)
        assert client.generate(ids, max_new_tokens=MAX_TOKENS).tokens == reply.tokens
    # only the first half known: no route, a RoutingError that says which layer is missing
    from p2pserve.errors import RoutingError

    with p2pserve.Client(peers=[(peers[0].maddrs[0], *peers[0].layers)], model=path) as client:
        with pytest.raises(RoutingError, match="layer 4"):
            client.chat(MESSAGES, max_new_tokens=2)


KV_SLOTS = 8 * 100  # token-layers: 50 blocks of 16; one session of a 96-token prompt over 8 layers takes 48


@pytest.fixture(scope="module")
def small_api(model_dir):
    """(url, path, peer) of a `p2pserve api` over one [0:8) peer with a KV budget of one session."""
    path = model_dir("llama")
    (peer,) = start_peers(path, [(0, 8)], "--kv-token-layers", str(KV_SLOTS), "--max-kv-fraction-per-owner", "1")
    server = None
    try:
        server, url = start_api(path, [(peer, 0, 8)], "--max-length", "64")
        yield url, path, peer
    finally:
        if server is not None:
            server.stop()
        peer.stop()


def test_429_while_every_route_is_overloaded_then_503_once_no_route_exists(small_api):
    """The swarm's own overload and no-route paths, end to end through the HTTP API."""
    import p2pserve

    url, path, peer = small_api
    kw = dict(model=oai(url).models.list().data[0].id, messages=MESSAGES, max_tokens=4, temperature=0)
    assert oai(url).chat.completions.create(**kw).choices[0].finish_reason in ("stop", "length")
    # another client holds a session whose prompt (81..96 tokens: 6 blocks of 16 in each of 8 layers,
    # 768 of the 800 token-layers) leaves less than a new session's one-block headroom
    from p2pserve.client.model_info import LocalModelInfo

    chat = LocalModelInfo.load(path).chat_ids
    long = next([{"role": "user", "content": "peer " * n}] for n in range(1, 200)
                if 81 <= len(chat([{"role": "user", "content": "peer " * n}])) <= 96)
    with p2pserve.Client(peers=[(peer.maddrs[0], 0, 8)], model=path, max_length=100) as holder:
        stream = holder.chat_stream(long, max_new_tokens=1000, ignore_eos=True)
        next(stream)
        for streamed in (False, True):
            with pytest.raises(openai.RateLimitError) as e:
                oai(url).chat.completions.create(**kw, stream=streamed)
            assert e.value.status_code == 429 and e.value.code == "overloaded", e.value.message
            assert e.value.response.headers["retry-after"] == "1"
        stream.close()
    # the session is closed: after the client's short overload mask, the same request is served;
    # the openai client's own retries (honouring Retry-After) wait that out
    reply = oai(url, retries=30).chat.completions.create(**kw)
    assert reply.choices[0].message.content is not None
    peer.kill()
    for streamed in (False, True):
        with pytest.raises(openai.InternalServerError) as e:
            oai(url).chat.completions.create(**kw, stream=streamed)
        assert e.value.status_code == 503 and e.value.code in ("no_route", "generation_failed"), e.value.message


def test_a_keyless_api_refuses_foreign_hosts_and_cross_site_requests(model_dir):
    """Without an API key, a web page is the way in: a cross-origin ``text/plain`` POST needs no
    preflight, and a DNS name rebound to 127.0.0.1 reads the answers. Both are refused with a 403;
    the same request from a local program is answered."""
    import json
    import urllib.error
    import urllib.request

    path = model_dir("llama")
    (peer,) = start_peers(path, [(0, 8)])
    server = None
    try:
        spec = f"{peer.maddrs[0]}@0:8"
        server = Child.spawn("api", ["api", "--port", "0", "--model", path, "--peers", spec])
        deadline = time.monotonic() + 120
        url = None
        while url is None and time.monotonic() < deadline and server.alive:
            ready = [line for line in list(server.lines) if line.startswith("P2PSERVE_API_READY")]
            url = dict(p.split("=", 1) for p in ready[0].split()[1:])["url"] if ready else None
            time.sleep(0.05)
        assert url is not None, server.output()
        model = LocalModelInfo.load(path).spec.model_id
        body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}).encode()

        def post(headers):
            req = urllib.request.Request(url + "/v1/completions", data=body, method="POST", headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        host = url.split("://", 1)[1]
        cross_site = post({"Content-Type": "text/plain", "Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"})
        assert cross_site[0] == 403 and cross_site[1]["error"]["code"] == "cross_site_request"
        rebound = post({"Content-Type": "application/json", "Host": "evil.example:" + host.rsplit(":", 1)[1]})
        assert rebound[0] == 403 and rebound[1]["error"]["code"] == "host_not_allowed"
        origin_only = post({"Content-Type": "text/plain", "Origin": "http://evil.example"})  # an older browser
        assert origin_only[0] == 403
        ok = post({"Content-Type": "application/json"})
        assert ok[0] == 200 and ok[1]["choices"], ok
    finally:
        if server is not None:
            server.stop()
        peer.stop()
