"""``/metrics`` scraped from a real swarm: the coordinator, the OpenAI API and the peers.

A bootstrap node, a coordinator and three tiny-Llama peers, all real processes on loopback with
``--metrics-port 0``: ``a`` serves layers [0, 4) with a KV budget of 1024 token-layers, ``b1`` and
``b2`` both serve [4, 8). An ``AsyncClient`` in this process follows the coordinator's plan, and
the OpenAI API is served over it (uvicorn, on a free port). Through the API: a chat and a
streamed completion. Then a stream through the same client loses the last peer of its route
after its fifth piece and fails over to the other replica (the stream is pulled by the test,
so the kill lands mid-generation). Last, through the API, a request whose session fits in
``a``'s free KV but not in the half of it one client may hold: ``a`` refuses it with a typed
``overloaded``, the client masks ``a``, finds no other route and answers 429.

Each endpoint is scraped over HTTP and parsed with ``prometheus_client``'s own parser; the
series must hold what happened: tokens equal to the completion tokens returned, one failover,
one ``overloaded`` hop on the client and on ``a``, one request ended as
``all_routes_overloaded``, the batch histogram summing to the tokens counter, KV used + free =
capacity (and used back to 0), a plan epoch >= 1 with timed solves.
No test asserts a duration; waits are generous bounds for a loaded two-core machine.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from p2pserve.cli.common import write_local_swarm_file
from p2pserve.client.api import AsyncClient
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.http.openai.server import OpenAIServer
from p2pserve.config import ApiConfig, ClientConfig, DHTConfig
from p2pserve.launch import Children
from p2pserve.peer.profiler import load_or_measure
from tests.support import wait_for

pytestmark = pytest.mark.integration

SWARM_ID = "metrics-test"
TIMING = dict(peer_refresh=0.5, candidate_refresh=0.5, plan_refresh=2.0, link_refresh=2.0, max_clock_skew=2.0)
DEADLINE = 240.0  # a generous bound for a loaded two-core machine, not a performance claim
KV = 1024  # a's KV budget in token-layers: 256 positions of its 4 layers
KEY = "sk-metrics-test"
MESSAGES = [{"role": "user", "content": "What is a peer-to-peer network?"}]
PEERS = {"a": "0:4", "b1": "4:8", "b2": "4:8"}


def metrics_url(child) -> str | None:
    """The url of the child's ``P2PSERVE_METRICS_READY`` line, once printed."""
    for line in reversed(child.output(1 << 20).splitlines()):
        if line.startswith("P2PSERVE_METRICS_READY"):
            return line.split("url=", 1)[1].strip()
    child.check()
    return None


def scrape(url: str, key: str | None = None) -> dict[tuple[str, tuple], float]:
    """Every sample at ``url``, parsed by prometheus_client: (name, sorted labels) -> value."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def get(samples, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def total(samples, name: str) -> float:
    """The sum over every label set of ``name``."""
    return sum(v for (n, _), v in samples.items() if n == name)


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream_usage(url: str, body: dict) -> dict:
    """POST a streamed request with usage; the usage object of its last chunk."""
    req = urllib.request.Request(url, json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    usage = None
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return usage


@pytest.fixture(scope="module")
def swarm(model_dir, tmp_path_factory):
    children = Children(tmp_path_factory.mktemp("metrics"))
    path = model_dir("llama")
    model = LocalModelInfo.load(path)
    load_or_measure(path, model.spec, "cpu", 4, 32)  # one cached profile for the three peers
    try:
        maddrs_file = children.logdir / "boot.maddrs"
        children.start("boot", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--maddrs-file", str(maddrs_file))
        wait_for(maddrs_file.exists, "bootstrap", DEADLINE)
        boot = maddrs_file.read_text().split()
        cfg_path = children.logdir / "swarm.json"
        write_local_swarm_file(cfg_path, model.spec, boot, SWARM_ID, "/ip4/127.0.0.1/tcp/0", TIMING, 0.5)
        children.start("coord", "coordinator", "--config", str(cfg_path), "--metrics-port", "0")
        for name, layers in PEERS.items():
            extra = ["--kv-token-layers", str(KV)] if name == "a" else []
            children.start(name, "peer", "--model", path, "--config", str(cfg_path), "--num-threads", "1",
                           "--max-layers", "4", "--layers", layers, "--metrics-port", "0", *extra)
        urls = {name: wait_for(lambda n=name: metrics_url(children.procs[n]), f"{name}'s metrics", DEADLINE) for name in
                ("coord", *PEERS)}
        ids = {name: wait_for(children.procs[name].ready, f"{name} ready", DEADLINE)["peer_id"] for name in PEERS}
        dht = DHTConfig(model=model.spec.model_id, swarm_id=SWARM_ID, initial_peers=tuple(boot),
                        host_maddrs=("/ip4/127.0.0.1/tcp/0",), client_mode=True, **TIMING)
        yield dict(children=children, model=model, dht=dht, urls=urls, ids=ids)
    finally:
        children.stop_all(timeout=0)


async def wait_for_plan(client: AsyncClient, ids: set[str]):
    """Until the plan routes over all three peers."""
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        await client.swarm_routes.refresh(force=True)
        plan = client.swarm_routes.plan
        if plan is not None and set(plan.spans) == ids and plan.max_flow > 0:
            return plan
        await asyncio.sleep(0.5)
    raise TimeoutError("no plan routing over all three peers")


async def drive(swarm) -> dict:
    """The requests; returns what the scrapes are checked against."""
    ids, children = swarm["ids"], swarm["children"]
    config = ClientConfig(hop_timeout_s=30.0, max_retries=3)
    async with AsyncClient(dht_config=swarm["dht"], config=config, seed=0, model_info=swarm["model"]) as client:
        await wait_for_plan(client, set(ids.values()))
        server = OpenAIServer(client, ApiConfig(port=0, api_key=KEY))
        base = f"http://127.0.0.1:{await server.start()}"
        try:
            status, chat = await asyncio.to_thread(post, base + "/v1/chat/completions",
                                                   {"model": client.model_id, "messages": MESSAGES, "max_tokens": 12})
            assert status == 200, chat
            usage = await asyncio.to_thread(stream_usage, base + "/v1/completions", {
                "model": client.model_id, "prompt": "Once upon a time", "max_tokens": 12, "stream": True,
                "stream_options": {"include_usage": True}})
            stream = client.chat_stream(MESSAGES, max_new_tokens=16, ignore_eos=True)
            pieces = 0
            async for _ in stream:
                pieces += 1
                if pieces == 5:  # the stream waits for us: the kill lands before its next token
                    victim = stream.pipeline.route[-1].peer_id
                    name = next(n for n, pid in ids.items() if pid == victim)
                    await asyncio.to_thread(children.procs[name].kill)
            assert len(stream.reply.routes) == 2, stream.reply.failures
            # a prompt of 150..200 positions: within a's 256 free, over the 128 (512 token-layers) one
            # client may hold; KV is paged, so its first Forward (the prompt's blocks) is refused
            long = next([{"role": "user", "content": "peer " * n}] for n in range(1, 400)
                        if 150 <= len(client.chat_prompt([{"role": "user", "content": "peer " * n}])) <= 200)
            status, refused = await asyncio.to_thread(post, base + "/v1/chat/completions", {
                "model": client.model_id, "messages": long, "max_tokens": 4})
            assert status == 429 and "one client may hold" in refused["error"]["message"], refused
            generated = chat["usage"]["completion_tokens"] + usage["completion_tokens"] + len(stream.reply.tokens)
            with pytest.raises(urllib.error.HTTPError, match="401"):
                await asyncio.to_thread(scrape, base + "/metrics")  # the API's key guards it too
            api = await asyncio.to_thread(scrape, base + "/metrics", KEY)
        finally:
            await server.close()
    survivor = next(n for n in ("b1", "b2") if n != name)
    return dict(api=api, generated=generated, killed=name, survivor=survivor)


def test_metrics_of_a_small_swarm(swarm):
    seen = asyncio.run(drive(swarm))
    urls = swarm["urls"]

    api = seen["api"]
    assert get(api, "p2pserve_client_generated_tokens_total") == seen["generated"] > 0
    assert get(api, "p2pserve_client_requests_total") == 4
    assert get(api, "p2pserve_client_time_to_first_token_seconds_count") == 3  # the refused one had none
    assert get(api, "p2pserve_client_hop_seconds_count", kind="decode") > 0
    # a ring's step counts once for its whole route: each request's prompt, and the failover's replay
    assert get(api, "p2pserve_client_hop_seconds_count", kind="prefill") >= 3 + 1
    assert get(api, "p2pserve_client_failovers_total") == 1
    assert get(api, "p2pserve_client_hop_errors_total", code="overloaded") == 1
    assert total(api, "p2pserve_client_hop_errors_total") == 2  # and the killed peer's hop
    assert get(api, "p2pserve_client_request_errors_total", code="all_routes_overloaded") == 1
    assert total(api, "p2pserve_client_request_errors_total") == 1

    coord = scrape(urls["coord"])
    assert get(coord, "p2pserve_coordinator_leader") == 1
    assert get(coord, "p2pserve_coordinator_plan_epoch") >= 1
    assert get(coord, "p2pserve_coordinator_solve_seconds_count") >= 1
    assert total(coord, "p2pserve_coordinator_plans_published_total") >= 1
    assert get(coord, "p2pserve_coordinator_plan_max_flow_tokens_per_second") > 0

    def settled(name: str):
        s = scrape(urls[name])
        return s if get(s, "p2pserve_peer_kv_used_token_layers") == 0 and get(s, "p2pserve_peer_queue_jobs") == 0 else None

    a = wait_for(lambda: settled("a"), "a's sessions to close", DEADLINE)  # every route closed its sessions
    assert get(a, "p2pserve_peer_kv_capacity_token_layers") == KV == get(a, "p2pserve_peer_kv_free_token_layers")
    assert get(a, "p2pserve_peer_errors_total", code="overloaded") == 1
    assert total(a, "p2pserve_peer_errors_total") == 1
    assert get(a, "p2pserve_peer_tokens_total") > 0
    assert get(a, "p2pserve_peer_batch_tokens_sum") == get(a, "p2pserve_peer_tokens_total")
    assert get(a, "p2pserve_peer_batch_sessions_count") == get(a, "p2pserve_peer_batch_tokens_count") > 0
    assert get(a, "p2pserve_peer_step_seconds_count") == get(a, "p2pserve_peer_batch_tokens_count")
    assert get(a, "p2pserve_peer_compute_restarts_total") == 0 and get(a, "p2pserve_peer_sessions") == 0
    assert (get(a, "p2pserve_peer_served_start_layer"), get(a, "p2pserve_peer_served_end_layer")) == (0, 4)
    b = wait_for(lambda: settled(seen["survivor"]), "the surviving replica's sessions to close", DEADLINE)
    assert get(b, "p2pserve_peer_kv_used_token_layers") + get(b, "p2pserve_peer_kv_free_token_layers") \
        == get(b, "p2pserve_peer_kv_capacity_token_layers") > 0
    assert get(b, "p2pserve_peer_tokens_total") > 0  # it served the replay at least
    assert get(b, "p2pserve_peer_queue_tokens") == 0
