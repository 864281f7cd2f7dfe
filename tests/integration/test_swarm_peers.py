"""The control plane with real processes: plan-driven peers profile, announce, get ranges from the
elected coordinator's plan, load them and serve; generation through the swarm matches
single-process `generate` token for token.

One bootstrap node, two trusted coordinators (priorities 2 and 1) and four `p2pserve peer`
processes (no --layers) on the tiny Llama start from nothing, all real processes on loopback.
The tests then check, in order (they share the swarm): the leader is elected and every layer is
served; killing the leader mid-generation, the other coordinator publishes a higher epoch while
generation goes on, token-identical; a killed peer leaves the next plan; a joining peer is placed
while no layer goes unserved. They share the swarm, but each waits for the state it asserts on
(a settled plan, or coord-1 leading), so each passes when run alone.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2pserve.client.api import AsyncClient
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.client.params import GenerationParams
from p2pserve.cli.common import write_local_swarm_file
from p2pserve.config import DHTConfig
from p2pserve.dht.swarm import Swarm
from tests.harness import reference_generate, run_chain
from tests.support import wait_for
from tests.support.swarm import chain_from_spans, killpg, settled_spans, uncovered

pytestmark = pytest.mark.integration

TIMING = dict(peer_refresh=0.5, candidate_refresh=0.5, plan_refresh=2.0, link_refresh=2.0, max_clock_skew=2.0)
DEADLINE = 120.0  # generous bound for a loaded two-core machine, not a performance claim
MAX_LAYERS = 5


def spawn(args, log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "p2pserve.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


COORDINATORS = (("coord-1", 2), ("coord-2", 1))  # (id, election priority): coord-1 leads


@pytest.fixture(scope="module")
def swarm(model_dir, tmp_path_factory):
    from p2pserve.dht.signing import load_or_create_key, public_key_text
    from p2pserve.peer.profiler import load_or_measure

    tmp = tmp_path_factory.mktemp("swarm")
    path = model_dir("llama")
    model = LocalModelInfo.load(path)
    # Profile once here (the peers find it in the shared cache), so that four peers do not all
    # run their timed forwards at once on two cores.
    load_or_measure(path, model.spec, "cpu", MAX_LAYERS)
    keys = {name: str(tmp / f"{name}.key") for name, _ in COORDINATORS}
    trusted = tuple(public_key_text(load_or_create_key(k)) for k in keys.values())
    procs: dict[str, subprocess.Popen] = {}
    observer = None
    try:
        maddrs_file = tmp / "boot.maddrs"
        procs["boot"] = spawn(["bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--maddrs-file", str(maddrs_file)],
                              tmp / "boot.log")
        wait_for(maddrs_file.exists, "bootstrap", DEADLINE)
        boot = maddrs_file.read_text().split()
        cfg_path = tmp / "swarm.json"
        write_local_swarm_file(cfg_path, model.spec, boot, "real-peers", "/ip4/127.0.0.1/tcp/0", TIMING, 0.5,
                               trusted_coordinators=trusted)
        for name, priority in COORDINATORS:
            # coord-1 simulates each placement before publishing it (the publish guard, on by default)
            guard = [] if name == "coord-1" else ["--no-publish-guard"]
            procs[name] = spawn(["coordinator", "--config", str(cfg_path), "--key-path", keys[name],
                                 "--priority", str(priority), "--coordinator-id", name, *guard], tmp / f"{name}.log")
        for i in range(4):
            procs[f"peer{i}"] = spawn_peer(path, cfg_path, tmp / f"peer{i}.log")
        observer = Swarm.create(DHTConfig(model=model.spec.model_id, swarm_id="real-peers", initial_peers=tuple(boot),
                                          host_maddrs=("/ip4/127.0.0.1/tcp/0",), client_mode=True,
                                          trusted_coordinators=trusted, **TIMING))
        yield dict(procs=procs, observer=observer, model=model, path=path, tmp=tmp, cfg_path=cfg_path)
    finally:
        if observer is not None:
            observer.shutdown()
        for p in procs.values():
            killpg(p)


def spawn_peer(path: str, cfg_path: Path, log: Path) -> subprocess.Popen:
    """A plan-driven peer (no --layers) of the test swarm."""
    return spawn(["peer", "--model", path, "--config", str(cfg_path), "--num-threads", "1",
                  "--max-layers", str(MAX_LAYERS), "--log-level", "INFO"], log)


def current(observer):
    async def read():
        plan = await observer.get_plan()
        peers = await observer.get_peers()
        return plan, {pid: s.record for pid, s in peers.items()}

    return asyncio.run(read())


def settled_plan(swarm, leader: str | None = None):
    """Wait for a plan whose ranges are all loaded and served, covering every layer (and
    published by ``leader``, if given)."""
    observer, L = swarm["observer"], swarm["model"].spec.num_layers

    def settled():
        plan, peers = current(observer)
        if leader is not None and (plan is None or plan.plan.leader_id != leader):
            return None
        return plan if settled_spans(plan.plan if plan else None, peers, L) else None

    return wait_for(settled, "a settled plan" + (f" by {leader}" if leader else ""), DEADLINE)


def test_plan_assigns_ranges_and_swarm_generates_exactly(swarm):
    observer, model = swarm["observer"], swarm["model"]
    L = model.spec.num_layers

    def served_and_covered():
        plan, peers = current(observer)
        spans = settled_spans(plan.plan if plan else None, peers, L)
        # coord-1 has the highest priority; a starved start-up may let its candidacy lapse for a
        # moment and coord-2 publish first, so wait for coord-1's plan rather than assert on one read
        return (plan, peers, spans) if (spans and len(spans) >= 2 and len(plan.plan.targets) == 4
                                        and plan.plan.leader_id == "coord-1") else None

    plan, peers, spans = wait_for(served_and_covered, "coord-1's settled plan, its ranges loaded and covering every layer", DEADLINE)
    assert plan.plan.max_flow > 0
    for info in peers.values():
        assert info.throughput_decode and info.max_layers == MAX_LAYERS  # real profile was announced
        # ... with the per-layer latency and KV size that make the swarm simulable
        assert info.latency is not None and info.kv_capacity() > 0
    # coord-1 ran its placements through the publish guard (a simulation of the live topology)
    wait_for(lambda: "guard" in (swarm["tmp"] / "coord-1.log").read_text(), "coord-1 to guard a placement", DEADLINE)
    messages = [{"role": "user", "content": "Hello! How are you today?"}]
    ids = model.chat_ids(messages)
    ref = reference_generate(swarm["path"], ids, 16)

    # The explicit chain over the plan's spans, and the swarm client, which routes by the plan's
    # flows and re-routes if a peer flipped to a new range after the plan it read.
    hops = chain_from_spans(spans, {p: i.addrs for p, i in peers.items()}, L)
    ours = asyncio.run(run_chain(model, hops, ids, GenerationParams(max_new_tokens=16, ignore_eos=True), 256))
    assert ours[: len(ref)] == ref

    async def via_client():
        async with AsyncClient(model=swarm["path"], dht_config=observer.config, seed=0, model_info=model) as client:
            return await client.chat(messages, max_new_tokens=16, ignore_eos=True)

    reply = asyncio.run(via_client())
    assert reply.tokens[: len(ref)] == ref


def test_killed_leader_is_replaced_and_generation_goes_on(swarm):
    """Kill the leader mid-stream: the stream finishes token-identical on the last plan, and the
    other coordinator publishes a higher epoch while the client keeps generating meanwhile."""
    observer, model, procs = swarm["observer"], swarm["model"], swarm["procs"]
    before = settled_plan(swarm, leader="coord-1")
    messages = [{"role": "user", "content": "Tell me about peer-to-peer networks."}]
    ids = model.chat_ids(messages)
    ref = reference_generate(swarm["path"], ids, 16)

    async def main():
        replies, epochs = [], []
        async with AsyncClient(model=swarm["path"], dht_config=observer.config, seed=1, model_info=model) as client:
            stream = client.chat_stream(messages, max_new_tokens=16, ignore_eos=True)
            n = 0
            async for _ in stream:
                n += 1
                if n == 4:  # crash: its candidacy and plan simply stop being refreshed
                    await asyncio.to_thread(killpg, procs.pop("coord-1"))
            replies.append(stream.reply)
            end = time.monotonic() + DEADLINE
            while True:  # serving goes on while the election runs
                replies.append(await client.chat(messages, max_new_tokens=16, ignore_eos=True))
                plan = await observer.get_plan()
                epochs.append(None if plan is None else (plan.plan.leader_id, plan.plan.epoch))
                if plan is not None and plan.plan.leader_id == "coord-2":
                    # and after the takeover, over the new leader's plan
                    await client.swarm_routes.refresh(force=True)
                    replies.append(await client.chat(messages, max_new_tokens=16, ignore_eos=True))
                    return replies, plan
                if time.monotonic() > end:
                    raise AssertionError(f"coord-2 never published; plans seen: {epochs}")

    replies, plan = asyncio.run(main())
    assert plan.plan.epoch > before.plan.epoch
    for reply in replies:
        assert reply.tokens[: len(ref)] == ref


def test_killed_peer_leaves_the_next_plan(swarm):
    observer, procs = swarm["observer"], swarm["procs"]
    plan = settled_plan(swarm)
    victim_pid = next(iter(plan.plan.spans))
    # find which process is that peer by its log line
    name = None
    for n in ("peer0", "peer1", "peer2", "peer3"):
        log = (swarm["tmp"] / f"{n}.log").read_text(errors="replace")
        if f"peer_id={victim_pid}" in log:
            name = n
    assert name is not None
    killpg(procs.pop(name))
    later = wait_for(lambda: (lambda p: p if p and victim_pid not in p.plan.spans
                              and victim_pid not in p.plan.targets else None)(current(observer)[0]),
                     "a plan without the killed peer", DEADLINE)
    assert later.plan.epoch > plan.plan.epoch  # a new plan, not a read that missed the peer


def test_a_joining_peer_is_placed_and_no_layer_goes_unserved_meanwhile(swarm):
    """Make-before-break: while the plan absorbs a new peer, every layer stays served.

    Peers that move load their new range first and keep the old one until the layers they drop
    are served by someone else (p2pserve/peer/handover.py). The observer keeps each peer's
    latest record (one DHT read missing a peer is not a departure) and checks coverage of the
    served ranges at every read until the plan has settled with the newcomer in it.
    """
    observer, model = swarm["observer"], swarm["model"]
    L = model.spec.num_layers

    def settled():
        plan, peers = current(observer)
        return settled_spans(plan.plan if plan else None, peers, L)

    before = wait_for(settled, "a settled plan before the join", DEADLINE)
    swarm["procs"]["peer4"] = spawn_peer(swarm["path"], swarm["cfg_path"], swarm["tmp"] / "peer4.log")
    latest: dict = {}
    lapses = []

    def watch():
        plan, peers = current(observer)
        for pid, info in peers.items():
            if pid not in latest or info.timestamp >= latest[pid].timestamp:
                latest[pid] = info
        served = [i.serving for i in latest.values() if i.state != "draining" and i.serving]
        missing = uncovered(served, L)
        if missing:
            lapses.append((missing, {p[-6:]: (i.state, i.serving, i.loading) for p, i in latest.items()}))
        spans = settled_spans(plan.plan if plan else None, peers, L)
        return spans if spans and set(spans) - set(before) else None

    after = wait_for(watch, "a settled plan that includes the new peer", DEADLINE)
    assert not lapses, lapses[:3]
    assert len(after) == len(before) + 1
