"""Helpers of the integration tests that run a swarm: its CLI flags, the bootstrap, plans
settling over served spans, a failover pipeline over peer processes, and a DHT observer."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

import p2pserve
from p2pserve.client.failover import FailoverState
from p2pserve.client.hop import Hop
from p2pserve.client.params import GenerationParams
from p2pserve.client.pipeline import Pipeline
from p2pserve.client.route_providers import PeerListRoutes
from p2pserve.config import ClientConfig, DHTConfig
from p2pserve.dht.swarm import Swarm
from p2pserve.launch import Children
from tests.harness import PeerProcess
from tests.support import wait_for

SWARM_DEADLINE = 240.0  # generous bound for a loaded two-core machine, not a performance claim


def killpg(p: subprocess.Popen, sig=signal.SIGKILL) -> None:
    """Signal a child's whole process group; SIGKILL it if it has not exited within 15 s."""
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass
    try:
        p.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)


def chain_from_spans(spans: dict[str, tuple[int, int]], addrs: dict[str, list[str]], num_layers: int) -> list[Hop]:
    """Greedy cover of [0, L) by served spans, allowing a hop to start mid-range."""
    hops, at = [], 0
    while at < num_layers:
        best = max((p for p, (a, b) in spans.items() if a <= at < b), key=lambda p: spans[p][1], default=None)
        if best is None:
            raise AssertionError(f"layer {at} not served: {spans}")
        hops.append(Hop(best, at, spans[best][1], tuple(addrs.get(best, ()))))
        at = spans[best][1]
    return hops


def uncovered(spans, num_layers: int) -> list[int]:
    """Layers of [0, num_layers) that none of the half-open ``spans`` holds."""
    return [layer for layer in range(num_layers) if not any(a <= layer < b for a, b in spans)]


def settled_spans(plan, peers: dict, num_layers: int):
    """The plan's spans if the plan is settled and served now, else None.

    Settled: every peer already serves its target (no flip is pending), each span is inside the
    range its peer announces, and the spans cover every layer. A chain built from them then
    reaches only loaded ranges, unless the coordinator re-plans in the meantime.
    """
    if plan is None:
        return None
    spans = {p: tuple(s) for p, s in plan.spans.items()}
    if {p: tuple(s) for p, s in plan.targets.items()} != spans:
        return None
    for pid, (a, b) in spans.items():
        info = peers.get(pid)
        if info is None or info.state != "serving" or not info.serving or not (info.serving[0] <= a and b <= info.serving[1]):
            return None
    return None if uncovered(spans.values(), num_layers) else spans


LOOPBACK = "/ip4/127.0.0.1/tcp/0"


TIMING_FLAGS = ("--peer-refresh", "0.5", "--candidate-refresh", "0.5", "--plan-refresh", "2", "--link-refresh", "2",
                "--max-clock-skew", "2")


MESSAGES = [{"role": "user", "content": "Hello, swarm started by hand!"}]


NEW_TOKENS = 12


def start_bootstrap(children: Children, tmp: Path) -> list[str]:
    """``p2pserve bootstrap`` on loopback as child "boot"; its multiaddrs once it wrote them."""
    maddrs_file = tmp / "boot.maddrs"
    children.start("boot", "bootstrap", "--host-maddrs", LOOPBACK, "--maddrs-file", str(maddrs_file))
    wait_for(maddrs_file.exists, "the bootstrap node", SWARM_DEADLINE, interval=0.5, children=children)
    return maddrs_file.read_text().split()


def chat_through(boot: list[str], path: str, **client_kw):
    config = ClientConfig(no_route_wait_s=60.0)
    with p2pserve.Client(initial_peers=boot, model=path, config=config, **client_kw) as client:
        return client.chat(MESSAGES, max_new_tokens=NEW_TOKENS, ignore_eos=True)


CONFIG = ClientConfig(hop_timeout_s=30.0, max_retries=3, ban_base_s=30.0)


def pipeline_over(transport, model, peers: list[PeerProcess], params: GenerationParams, seed=0) -> Pipeline:
    """A failover pipeline over the known ``peers`` (IWRR over every valid edge)."""
    spec = model.spec
    routes = PeerListRoutes(spec.num_layers, [p.hop() for p in peers], seed=seed)
    return Pipeline(transport, routes, spec.model_id, spec.num_layers, 256, params.validate(), CONFIG,
                    FailoverState(CONFIG))


def _observer(boot, name: str, num_layers: int, **timing):
    """A DHT node of the test's own (it reads, and may publish a plan), on the swarm's timing."""

    timing = {"peer_refresh": 0.5, "plan_refresh": 2.0, "max_clock_skew": 2.0, **timing}
    return Swarm.create(DHTConfig(model=name, initial_peers=tuple(boot), host_maddrs=(LOOPBACK,), num_layers=num_layers,
                                  **timing))


def _records(obs):
    return {pid: s.record for pid, s in asyncio.run(obs.get_peers()).items()}
