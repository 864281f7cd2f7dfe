"""The web dashboard in a real headless Chromium (Debian's ``chromium`` + ``chromium-driver``,
driven by Selenium), over a real swarm.

A bootstrap node, a coordinator (``--web-port 0``: its dashboard's JSON is the test's reference),
three plan-driven ``p2pserve peer`` processes on the tiny Llama, ``p2pserve status --web`` and
``p2pserve api --dashboard``, all real processes on loopback. The tests open the pages and check
that every peer and the layer coverage appear, that a request's route shows on the API's page,
and that the status page follows a peer's crash (its row goes, the coverage drops). Screenshots
go to ``$P2PSERVE_ARTIFACTS`` or ``benchmarks/results/`` (``dashboard.png``: the live swarm).

A first test needs no swarm: the page over a fake swarm whose peer announces markup as its
device and version shows it as text, and runs none of it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from p2pserve.cli.common import write_local_swarm_file
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.launch import Children
from tests.integration.processes import REPO
from tests.support import wait_for

pytestmark = pytest.mark.integration

TIMING = dict(peer_refresh=0.5, candidate_refresh=0.5, plan_refresh=1.0, link_refresh=2.0, max_clock_skew=2.0)
DEADLINE = 240.0  # generous for a loaded two-core machine, not a performance claim
MAX_LAYERS = 5  # each peer holds at most 5 of the tiny model's 8 layers: the plan must combine them
INSTALL_HINT = "run `bash scripts/install.sh --test` as root (installs Debian's chromium and chromium-driver)"

# what the page shows, read in the browser (data attributes set by dashboard.js)
PAGE_STATE_JS = """
const rows = [...document.querySelectorAll('#peers tbody tr')];
return {renders: Number(document.body.getAttribute('data-renders')),
        peers: rows.map((r) => r.getAttribute('data-peer-id')),
        states: rows.map((r) => r.getAttribute('data-state')),
        serving: document.getElementById('coverage').getAttribute('data-serving'),
        plan_nodes: document.querySelectorAll('#plan-graph .plan-node').length,
        flows: document.querySelectorAll('#plan-graph .flow').length,
        routes: [...document.querySelectorAll('#routes tbody tr')].map((r) => r.textContent),
        status: document.getElementById('status').textContent,
        pwned: window.__pwned === undefined ? null : window.__pwned};
"""


def artifacts() -> Path:
    """Where screenshots go: ``$P2PSERVE_ARTIFACTS`` if set, else ``benchmarks/results/``."""
    path = Path(os.environ.get("P2PSERVE_ARTIFACTS") or REPO / "benchmarks" / "results")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium (Selenium with Debian's chromium-driver), or a skip saying how to get one."""
    webdriver = pytest.importorskip("selenium.webdriver", reason=f"selenium is not installed: {INSTALL_HINT}")
    from selenium.webdriver.chrome.service import Service

    binary = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
    driver_path = shutil.which("chromedriver")
    if binary is None or driver_path is None:
        pytest.skip(f"chromium or chromedriver not found: {INSTALL_HINT}")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1700"):
        options.add_argument(arg)  # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def page_state(driver) -> dict:
    return driver.execute_script(PAGE_STATE_JS)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


@contextmanager
def fake_dashboard(view):
    """A :class:`DashboardServer` over ``view`` (a FakeSwarm) on a thread of its own; yields its url."""
    from p2pserve.config import DashboardConfig
    from p2pserve.dashboard.server import DashboardServer
    from p2pserve.dashboard.watch import SwarmWatch

    started: dict = {}
    ready = threading.Event()

    async def main() -> None:
        config = DashboardConfig(port=0, refresh_s=0.3)
        server = DashboardServer(SwarmWatch(view, config, source="status", model="m", swarm_id="s"), config)
        started["stop"], started["loop"] = asyncio.Event(), asyncio.get_running_loop()
        await server.start()
        started["url"] = server.url
        ready.set()
        await started["stop"].wait()
        await server.close()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(30), "the dashboard did not start"
    try:
        yield started["url"]
    finally:
        started["loop"].call_soon_threadsafe(started["stop"].set)
        thread.join(10)


def test_markup_from_peers_is_shown_as_text_and_never_runs(browser):
    from p2pserve.testing.dashboard import HOSTILE, fake_dashboard_swarm, kill_peer

    view = fake_dashboard_swarm(now=time.time(), hostile=True)
    with fake_dashboard(view) as url:
        browser.get(url)
        state = wait_for(lambda: (s := page_state(browser))["renders"] >= 1 and s, "a first render", 30)
        assert sorted(state["peers"]) == ["peerA", "peerB", "peerC"] and state["serving"] == "1,1,1,1,2,2,2,2"
        cells = browser.execute_script(
            "return [...document.querySelectorAll('#peers tbody tr[data-peer-id=peerB] td')].map((td) => td.title)")
        assert HOSTILE in cells  # the whole string, as text (the cell shows it clipped, its title in full)
        assert browser.execute_script("return document.querySelectorAll('#peers img, #peers script').length") == 0
        kill_peer(view, "peerC")
        state = wait_for(lambda: (s := page_state(browser))["peers"] == ["peerA", "peerB"] and s, "peerC's row to go", 30)
        assert state["serving"] == "1,1,1,1,1,1,1,1" and state["pwned"] is None


@pytest.fixture(scope="module")
def swarm(model_dir, tmp_path_factory):
    """The processes of the module docstring; yields their urls, the peers' ids and the children."""
    from p2pserve.peer.profiler import load_or_measure

    tmp = tmp_path_factory.mktemp("dashboard")
    path = model_dir("llama")
    model = LocalModelInfo.load(path)
    load_or_measure(path, model.spec, "cpu", MAX_LAYERS)  # once here: the peers find it in the cache
    kids = Children(tmp, env={"PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    try:
        maddrs = tmp / "boot.maddrs"
        kids.start("boot", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--maddrs-file", str(maddrs))
        wait_for(maddrs.exists, "the bootstrap node", DEADLINE)
        cfg = tmp / "swarm.json"
        write_local_swarm_file(cfg, model.spec, maddrs.read_text().split(), "dash", "/ip4/127.0.0.1/tcp/0", TIMING, 0.5)
        kids.start("coord", "coordinator", "--config", str(cfg), "--web-port", "0", "--coordinator-id", "coord")
        for i in range(3):
            kids.start(f"peer{i}", "peer", "--model", path, "--config", str(cfg), "--num-threads", "1",
                       "--max-layers", str(MAX_LAYERS), "--log-level", "WARNING")
        kids.start("status", "status", "--config", str(cfg), "--web", "--port", "0", "--refresh", "0.5")
        kids.start("api", "api", "--config", str(cfg), "--model", path, "--port", "0", "--dashboard")
        urls = {name: wait_for(lambda n=name: (kids.check() or _ready_url(kids.procs[n].output(20000))),
                                 f"{name}'s dashboard", DEADLINE) for name in ("coord", "status", "api")}
        peer_ids = [wait_for(lambda n=f"peer{i}": kids.procs[n].ready(), f"peer{i} ready", DEADLINE)["peer_id"]
                    for i in range(3)]
        yield dict(kids=kids, urls=urls, peer_ids=peer_ids, model=model)
    finally:
        kids.stop_all(timeout=5)


def _ready_url(output: str):
    lines = [ln for ln in output.splitlines() if ln.startswith("P2PSERVE_DASHBOARD_READY")]
    return lines[-1].split("url=", 1)[1].strip() if lines else None


def settled(swarm, peer_ids) -> dict | None:
    """The coordinator's /api/swarm once ``peer_ids`` all serve and every layer is covered."""
    d = get_json(swarm["urls"]["coord"] + "api/swarm")
    serving = {p["peer_id"] for p in d["peers"] if p["state"] == "serving"}
    ok = serving == set(peer_ids) and d["plan"] and d["plan"]["flows"] and not d["coverage"]["uncovered"]
    return d if ok else None


def test_api_dashboard_shows_the_routes_of_its_requests(swarm, browser):
    wait_for(lambda: settled(swarm, swarm["peer_ids"]), "a plan over the three peers", DEADLINE)
    api = swarm["urls"]["api"].removesuffix("dashboard/")
    body = json.dumps({"model": swarm["model"].spec.model_id, "max_tokens": 8,
                       "messages": [{"role": "user", "content": "Hello!"}]}).encode()
    req = urllib.request.Request(api + "v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
    routes = get_json(api + "api/swarm")["routes"]
    assert len(routes) == 1 and routes[0]["outcome"] in ("stop", "length")
    hops = routes[0]["hops"]
    assert hops[0]["start"] == 0 and hops[-1]["end"] == swarm["model"].spec.num_layers
    assert {h["peer_id"] for h in hops} <= set(swarm["peer_ids"])
    served = wait_for(lambda: [x for x in get_json(api + "api/swarm")["history"]["served"] if x], "served tokens/s", 60)
    assert served[-1] > 0  # the request's 8 tokens, over the refresh period they fell in
    browser.get(swarm["urls"]["api"])
    state = wait_for(lambda: (s := page_state(browser))["routes"] and s, "the route on the API's page", 60)
    assert "→" in state["routes"][0] or len(hops) == 1
    browser.save_screenshot(str(artifacts() / "dashboard_api.png"))


def test_status_page_shows_every_peer_and_follows_a_crash(swarm, browser):
    ids = swarm["peer_ids"]
    ref = wait_for(lambda: settled(swarm, ids), "a plan over the three peers", DEADLINE)
    browser.get(swarm["urls"]["status"])

    def shows_all():
        s = page_state(browser)
        return s if sorted(s["peers"]) == sorted(ids) and all(x == "serving" for x in s["states"]) else None

    state = wait_for(shows_all, "every peer on the status page", DEADLINE)
    serving = wait_for(lambda: (s := page_state(browser)["serving"]) and "0" not in s.split(",") and s,
                         "full coverage on the page", DEADLINE)
    assert len(serving.split(",")) == ref["num_layers"] and state["plan_nodes"] >= 3 + 2  # peers + source, sink
    browser.save_screenshot(str(artifacts() / "dashboard.png"))

    victim = ids[-1]
    swarm["kids"].procs["peer2"].kill()
    before = sum(map(int, serving.split(",")))

    def victim_gone():
        s = page_state(browser)
        return s if victim not in s["peers"] and sum(map(int, s["serving"].split(","))) < before else None

    state = wait_for(victim_gone, "the killed peer to leave the page and the coverage to drop", DEADLINE)
    assert sorted(state["peers"]) == sorted(ids[:-1])
    browser.save_screenshot(str(artifacts() / "dashboard_peer_killed.png"))


def test_a_dashboard_port_in_use_is_a_clean_error():
    """``coordinator --web-port`` on a taken port exits with code 2 and one line, not a traceback."""
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "p2pserve.cli", "coordinator", "--swarm-model", "x", "--num-layers",
                            "4", "--web-port", str(port), "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "cannot listen" in p.stdout and "Traceback" not in p.stderr
