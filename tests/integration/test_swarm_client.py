"""The Python client in swarm mode: routes from the published plan, failover over the swarm.

A bootstrap node, one coordinator and four plan-driven peers (``--max-layers 4``) on the tiny
Llama, all real processes on loopback. ``AsyncClient`` finds them through the DHT, routes by
IWRR over the plan's flows, and must reproduce single-process ``generate`` — also when a peer
of its route is killed mid-generation (the other replica of its layers takes over).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2pserve.client.api import AsyncClient
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.config import ClientConfig
from p2pserve.cli.common import write_local_swarm_file
from p2pserve.dht.config import DHTConfig
from tests.harness import reference_generate
from tests.integration.test_swarm_peers import settled_spans, uncovered

pytestmark = pytest.mark.integration

SWARM_ID = "client-swarm"
TIMING = dict(peer_refresh=0.5, candidate_refresh=0.5, plan_refresh=2.0, link_refresh=2.0, max_clock_skew=2.0)
DEADLINE = 150.0  # a generous bound for a loaded two-core machine, not a performance claim
CONFIG = ClientConfig(hop_timeout_s=30.0, max_retries=3)


def spawn(args, log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "p2pserve.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def killpg(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(15)


def wait_for(fn, what: str, deadline: float = DEADLINE):
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        value = fn()
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"timed out waiting for {what}")


def covered(spans, num_layers) -> bool:
    return not uncovered(spans, num_layers)


@pytest.fixture(scope="module")
def swarm(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("client_swarm")
    path = model_dir("llama")
    model = LocalModelInfo.load(path)
    procs: dict[str, subprocess.Popen] = {}
    try:
        maddrs_file = tmp / "boot.maddrs"
        procs["boot"] = spawn(["bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--maddrs-file", str(maddrs_file)],
                              tmp / "boot.log")
        wait_for(maddrs_file.exists, "bootstrap")
        boot = maddrs_file.read_text().split()
        cfg_path = tmp / "swarm.json"
        write_local_swarm_file(cfg_path, model.spec, boot, SWARM_ID, "/ip4/127.0.0.1/tcp/0", TIMING, 0.5)
        procs["coord"] = spawn(["coordinator", "--config", str(cfg_path)], tmp / "coord.log")
        for i in range(4):
            procs[f"peer{i}"] = spawn(["peer", "--model", path, "--config", str(cfg_path), "--num-threads", "1",
                                       "--max-layers", "4"], tmp / f"peer{i}.log")
        dht = DHTConfig(model=model.spec.model_id, swarm_id=SWARM_ID, initial_peers=tuple(boot),
                        host_maddrs=("/ip4/127.0.0.1/tcp/0",), client_mode=True, **TIMING)
        yield dict(procs=procs, model=model, path=path, tmp=tmp, dht=dht)
    finally:
        for p in procs.values():
            killpg(p)


async def wait_for_plan(client: AsyncClient, min_peers: int):
    """Until the plan has settled (``settled_spans``) with flows and at least ``min_peers`` peers."""
    routes = client.swarm_routes
    L = client.info.spec.num_layers
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        await routes.refresh(force=True)
        plan, peers = routes.plan, routes._peers
        if plan is not None and plan.flows and len(plan.spans) >= min_peers and settled_spans(plan, peers, L):
            return plan
        await asyncio.sleep(0.5)
    raise TimeoutError("no plan covering every layer with loaded ranges")


def peer_process(swarm, peer_id: str) -> subprocess.Popen:
    for name, proc in swarm["procs"].items():
        if name.startswith("peer") and f"peer_id={peer_id}" in (swarm["tmp"] / f"{name}.log").read_text(errors="replace"):
            return proc
    raise AssertionError(f"no process for peer {peer_id}")


def test_swarm_chat_follows_the_plan_and_survives_a_kill(swarm):
    model, path = swarm["model"], swarm["path"]
    messages = [{"role": "user", "content": "Hello from the swarm!"}]
    ids = model.chat_ids(messages)
    ref = reference_generate(path, ids, 16)

    async def main():
        async with AsyncClient(model=path, dht_config=swarm["dht"], config=CONFIG, seed=0, model_info=model) as client:
            plan = await wait_for_plan(client, min_peers=3)
            reply = await client.chat(messages, max_new_tokens=16, ignore_eos=True)
            flow_edges = {(f.src, f.dst) for f in plan.flows if f.rate > 0}
            path_ids = ["source"] + [h.peer_id for h in reply.route] + ["sink"]
            # the route uses only edges that carry flow in the plan
            assert set(zip(path_ids, path_ids[1:])) <= flow_edges, (path_ids, flow_edges)

            # a victim on the route whose layers someone else still serves
            spans = dict(plan.spans)
            victim = next((h.peer_id for h in reply.route
                           if covered([s for p, s in spans.items() if p != h.peer_id], model.spec.num_layers)), None)
            if victim is None:
                pytest.skip(f"the plan has no redundancy to fail over to: {spans}")
            stream = client.chat_stream(messages, max_new_tokens=16, ignore_eos=True, seed=None)
            n = 0
            async for _ in stream:
                n += 1
                if n == 5:
                    if victim not in {h.peer_id for h in stream.pipeline.route}:
                        victim2 = next((h.peer_id for h in stream.pipeline.route if covered(
                            [s for p, s in spans.items() if p != h.peer_id], model.spec.num_layers)), None)
                        assert victim2 is not None
                        target = victim2
                    else:
                        target = victim
                    await asyncio.to_thread(killpg, peer_process(swarm, target))
            return reply, stream.reply

    first, second = asyncio.run(main())
    assert first.tokens[: len(ref)] == ref
    assert second.tokens[: len(ref)] == ref
    assert len(second.failures) >= 1 and len(second.routes) >= 2
