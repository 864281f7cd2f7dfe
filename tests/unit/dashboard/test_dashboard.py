"""The dashboard's data and HTTP shell without a network: the ``/api/swarm`` document from a fake
swarm (``p2pserve.testing.dashboard``), the tokens/s history, the request log, and the ASGI app
through FastAPI's TestClient, alone and mounted under the OpenAI API."""

from __future__ import annotations

import asyncio
import re
from importlib import resources

import pytest
from fastapi.testclient import TestClient

from p2pserve.http.openai.app import create_app
from p2pserve.config import ApiConfig, DashboardConfig
from p2pserve.dashboard.app import CSP, create_dashboard_app, mount_dashboard
from p2pserve.dashboard.document import swarm_document
from p2pserve.dashboard.history import History
from p2pserve.dashboard.requests import RecordingClient, RequestLog
from p2pserve.dashboard.snapshot import read_snapshot
from p2pserve.dashboard.watch import SwarmWatch
from p2pserve.errors import ConfigError
from p2pserve.testing import FakeClient, FakeClock
from p2pserve.testing.dashboard import HOSTILE, NUM_LAYERS, SPANS, fake_dashboard_swarm, kill_peer


NOW = 1001.0  # just after the fake swarm's records were published


def watch_of(view, clock=None, **kw) -> SwarmWatch:
    return SwarmWatch(view, DashboardConfig(refresh_s=0.5), source="status", model="m", swarm_id="s",
                      num_layers=NUM_LAYERS, clock=clock or FakeClock(NOW), **kw)


def test_document_lists_peers_coverage_plan_and_links():
    view = fake_dashboard_swarm()
    snap = asyncio.run(read_snapshot(view, FakeClock(NOW)))
    d = swarm_document(snap, source="status", model="m", swarm_id="s", num_layers=NUM_LAYERS)
    assert {(p["peer_id"], p["state"], p["start"], p["end"]) for p in d["peers"]} == \
        {(pid, "serving", a, b) for pid, (a, b) in SPANS.items()}
    assert d["coverage"]["serving"] == [1, 1, 1, 1, 2, 2, 2, 2]
    assert d["coverage"]["planned"] == [1, 1, 1, 1, 2, 2, 2, 2] and d["coverage"]["uncovered"] == []
    plan = d["plan"]
    assert (plan["epoch"], plan["leader"]) == (3, "coord")
    assert {(f["src"], f["dst"]) for f in plan["flows"]} >= {("source", "peerA"), ("peerB", "sink")}
    assert [r["peer_id"] for r in plan["ranges"]] == ["peerA", "peerB", "peerC"]
    assert len(d["links"]) == 6 and {"bandwidth_Bps", "rtt_s"} <= set(d["links"][0])
    by_id = {p["peer_id"]: p for p in d["peers"]}
    assert by_id["peerA"]["observed_tps"] == 50.0 and by_id["peerA"]["observed_by"] == 1
    assert by_id["peerC"]["observed_tps"] is None and by_id["peerC"]["relayed"] is True
    assert by_id["peerA"]["decode_tps"] == 25.0 and by_id["peerA"]["version"] == "0.1.0"
    assert d["routes"] is None and d["observations"][0]["reporter"] == "client"


def test_a_dead_peer_leaves_the_document_and_the_coverage_drops():
    view = fake_dashboard_swarm()
    watch = watch_of(view)
    asyncio.run(watch.refresh())
    kill_peer(view, "peerC")
    asyncio.run(watch.refresh())
    d = watch.document()
    assert [p["peer_id"] for p in d["peers"]] == ["peerA", "peerB"]
    assert d["coverage"]["serving"] == [1] * 8
    assert all("peerC" not in (li["src"], li["dst"]) for li in d["links"])  # links to the dead peer dropped
    kill_peer(view, "peerB")
    asyncio.run(watch.refresh())
    assert watch.document()["coverage"]["uncovered"] == [4, 5, 6, 7]


def test_coverage_counts_loading_apart_and_skips_draining_peers():
    from dataclasses import replace

    from msgspec.structs import replace as with_fields

    snap = asyncio.run(read_snapshot(fake_dashboard_swarm(), FakeClock(NOW)))
    peers = dict(snap.peers)
    peers["peerA"] = with_fields(peers["peerA"], state="loading", loading=(0, 6))
    peers["peerC"] = with_fields(peers["peerC"], state="draining")
    d = swarm_document(replace(snap, peers=peers), source="status", model="m", swarm_id="s", num_layers=NUM_LAYERS)
    assert d["coverage"]["serving"] == [1, 1, 1, 1, 1, 1, 1, 1]  # peerA still serves [0, 4); peerC drains
    assert d["coverage"]["loading"] == [1, 1, 1, 1, 1, 1, 0, 0]


def test_a_failed_read_keeps_the_last_snapshot_and_says_why():
    view = fake_dashboard_swarm()
    clock = FakeClock(NOW)
    watch = watch_of(view, clock)
    asyncio.run(watch.refresh())

    async def broken():
        raise TimeoutError("dht down")

    view.get_peers = broken
    clock.advance(10)
    asyncio.run(watch.refresh())
    d = watch.document()
    assert len(d["peers"]) == 3 and "dht down" in d["error"] and d["stale_s"] == 10.0


def test_history_is_bounded_aligned_and_keeps_the_fastest_peers():
    h = History(max_samples=3, max_peers=2)
    assert h.served_rate(0.0, 0) is None  # first call: no interval yet
    for i in range(5):
        h.add(float(i), 10.0 + i, h.served_rate(float(i + 1), 10 * (i + 1)), {"a": 1.0, "b": 5.0 + i, "c": 3.0})
    j = h.as_json()
    assert j["t"] == [2.0, 3.0, 4.0] and j["max_flow"] == [12.0, 13.0, 14.0]
    assert j["served"] == [10.0, 10.0, 10.0]
    assert set(j["observed"]) == {"b", "c"} and j["observed"]["b"] == [7.0, 8.0, 9.0]
    assert History().served_rate(1.0, None) is None  # no request log: no served series


def test_request_log_records_routes_of_streams_and_failures():
    log = RequestLog(max_records=2)

    async def drain(stream):
        await stream.open()
        return [piece async for piece in stream]

    client = RecordingClient(FakeClient(), log)
    assert asyncio.run(drain(client.generate_stream([1, 2, 3]))) == ["Hello", " world"]
    assert log.recent()[0]["hops"] == [{"peer_id": "peerA", "start": 0, "end": 8}]
    assert log.recent()[0]["tokens_per_s"] == 10.0 and log.tokens_total == 2
    with pytest.raises(RuntimeError):
        asyncio.run(drain(RecordingClient(FakeClient(stream_error=RuntimeError("peer gone")), log).generate_stream([1])))
    with pytest.raises(RuntimeError):
        asyncio.run(drain(RecordingClient(FakeClient(error=RuntimeError("no route")), log).generate_stream([1])))
    recent = log.recent()
    assert [r["outcome"] for r in recent] == ["RuntimeError", "RuntimeError"]  # bounded, newest first
    assert (log.requests_total, log.failures_total, log.tokens_total) == (3, 2, 2)
    assert client.model_id == FakeClient.model_id  # everything else is the client's own


def test_dashboard_app_serves_the_page_with_a_strict_policy():
    app = create_dashboard_app(watch_of(fake_dashboard_swarm()))
    with TestClient(app) as http:
        page = http.get("/")
        assert page.status_code == 200 and page.headers["content-security-policy"] == CSP
        assert "'unsafe-inline'" not in CSP and "script-src 'self'" in CSP
        assert page.headers["x-frame-options"] == "DENY" and page.headers["x-content-type-options"] == "nosniff"
        js = http.get("/static/dashboard.js")
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
        for bad in ("/static/index.html", "/static/../app.py", "/static/%2e%2e%2fapp.py", "/static/nope.js"):
            assert http.get(bad).status_code == 404, bad


def test_api_swarm_answers_from_memory_with_the_required_keys():
    view = fake_dashboard_swarm(hostile=True)
    watch = watch_of(view)
    asyncio.run(watch.refresh())
    reads = view.calls["get_peers"]
    with TestClient(create_dashboard_app(watch)) as http:
        for _ in range(3):
            d = http.get("/api/swarm").json()
    assert view.calls["get_peers"] == reads  # polling costs no DHT read
    assert {"peers", "plan", "links", "coverage", "history"} <= set(d)
    assert {"peer_id", "state", "start", "end"} <= set(d["peers"][0])
    assert {"epoch", "leader", "flows"} <= set(d["plan"])
    assert HOSTILE in {p["device"] for p in d["peers"]}  # data stays data; the page renders it as text


def test_mounted_under_the_api_next_to_the_openai_routes():
    fake = FakeClient()
    served = RecordingClient(fake, RequestLog())
    watch = SwarmWatch(fake_dashboard_swarm(), source="api", model="m", swarm_id="s", requests=served.log)
    app = create_app(served, ApiConfig(api_key="k"))
    mount_dashboard(app, watch)
    with TestClient(app) as http:
        assert http.get("/dashboard", follow_redirects=False).headers["location"] == "/dashboard/"
        assert "p2pserve swarm" in http.get("/dashboard/").text
        assert http.get("/dashboard/static/dashboard.css").status_code == 200
        assert http.get("/api/swarm").json()["source"] == "api"
        assert http.get("/dashboard/api/swarm").json()["routes"] == []
        assert http.get("/v1/models").status_code == 401  # the key still guards the API
        body = {"model": fake.model_id, "messages": [{"role": "user", "content": "hi"}]}
        assert http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer k"}).status_code == 200
        routes = http.get("/api/swarm").json()["routes"]
        assert [r["hops"] for r in routes] == [[{"peer_id": "peerA", "start": 0, "end": 8}]]  # the request's route


def test_the_page_never_parses_network_strings_as_markup():
    js = (resources.files("p2pserve.dashboard") / "static" / "dashboard.js").read_text()
    html = (resources.files("p2pserve.dashboard") / "static" / "index.html").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
                 "setAttribute(\"on", "setAttribute('on", ".style.", "href"):
        assert sink not in js, sink
    assert "<script>" not in html and not re.search(r"\son\w+=", html)  # nothing inline for the CSP to allow


def test_dashboard_config_is_checked():
    with pytest.raises(ConfigError):
        DashboardConfig(refresh_s=0)
    with pytest.raises(ConfigError):
        DashboardConfig(port=70000)
