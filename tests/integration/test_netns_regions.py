"""Four real peers in two "regions" joined by a 20 Mbit/s link (network namespaces + tc tbf).

Region A (peers 1, 2) and region B (peers 3, 4) are network namespaces on one bridge; each
peer's traffic to the other region goes through a `tc tbf` shaper at 20 Mbit/s, traffic inside a
region is unshaped. The bootstrap node, the coordinator and the client run in the root namespace. Checks:
the announced LinkInfo measures the cross-region links within ±30% of the shaping, the plan puts
most of its flow inside regions, and generation through the swarm matches `generate`.

The model is a tiny Llama with a very wide residual stream (hidden 8192, 32 KB of activation
per token in fp32) but thin projections, so that the 20 Mbit/s link, not compute, is what limits a
cross-region pipeline. Needs root and iproute2; skipped otherwise.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time

import pytest

from p2pserve.client.failover import HopFailure
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.client.params import GenerationParams
from p2pserve.cli.common import write_local_swarm_file
from p2pserve.config import DHTConfig
from p2pserve.dht.swarm import Swarm
from p2pserve.errors import GenerationFailedError, RangeMovedError
from tests.harness import reference_generate, run_chain
from tests.support import wait_for
from tests.support.swarm import chain_from_spans, killpg, settled_spans

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                       reason="needs root, ip and tc for network namespaces"),
]

RATE_BITS = 20e6
TIMING = dict(peer_refresh=0.5, candidate_refresh=0.5, plan_refresh=2.0, link_refresh=2.0, max_clock_skew=2.0)
SUBNET = "10.77.13"
TAG = f"p2t{os.getpid() % 10000}"


def sh(*cmd: str, ns: str | None = None) -> None:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    subprocess.run(full, check=True, capture_output=True)


REGION_NETS = {"A": f"{SUBNET}.16/28", "B": f"{SUBNET}.32/28"}
PEER_IPS = {1: ("A", 17), 2: ("A", 18), 3: ("B", 33), 4: ("B", 34)}


def build_network() -> dict[str, str]:
    """One bridge, four peer namespaces; every peer's traffic to the other region is shaped.

    Each peer's egress has an HTB root whose default class is unshaped and whose second class,
    selected by a u32 filter on the other region's subnet, ends in a `tc tbf` at 20 Mbit/s. So
    every cross-region path (in each direction) is its own 20 Mbit/s link, and probes between
    different pairs never share one shaper.
    """
    sh("ip", "link", "add", f"{TAG}br", "type", "bridge")
    sh("ip", "link", "set", f"{TAG}br", "up")
    sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", f"{TAG}br")
    ips = {}
    for i, (region, last) in PEER_IPS.items():
        ns, host = f"{TAG}n{i}", f"{TAG}v{i}"
        other = REGION_NETS["B" if region == "A" else "A"]
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", host, "master", f"{TAG}br")
        sh("ip", "link", "set", host, "up")
        sh("ip", "addr", "add", f"{SUBNET}.{last}/24", "dev", "eth0", ns=ns)
        sh("ip", "link", "set", "eth0", "up", ns=ns)
        sh("ip", "link", "set", "lo", "up", ns=ns)
        sh("tc", "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "10", ns=ns)
        sh("tc", "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit", ns=ns)
        sh("tc", "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:20", "htb", "rate", "10gbit", ns=ns)
        sh("tc", "qdisc", "add", "dev", "eth0", "parent", "1:20", "handle", "20:", "tbf", "rate", "20mbit",
           "burst", "32kbit", "latency", "50ms", ns=ns)
        sh("tc", "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
           "match", "ip", "dst", other, "flowid", "1:20", ns=ns)
        ips[ns] = f"{SUBNET}.{last}"
    return ips


def tear_down_network() -> None:
    for i in PEER_IPS:
        subprocess.run(["ip", "netns", "del", f"{TAG}n{i}"], capture_output=True)
    subprocess.run(["ip", "link", "del", f"{TAG}br"], capture_output=True)


@pytest.fixture(scope="module")
def regions(tmp_path_factory):
    from p2pserve.model.tiny import build_tiny_model

    tmp = tmp_path_factory.mktemp("regions")
    path = str(build_tiny_model("llama", tmp / "wide", num_layers=8, hidden_size=8192, intermediate_size=128,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    model = LocalModelInfo.load(path)
    # Profile once here (the peers find it in the shared cache), so that four peers do not
    # burn both cores on timed forwards while their first link probes run.
    from p2pserve.peer.profiler import load_or_measure

    load_or_measure(path, model.spec, "cpu", 4)
    procs: dict[str, subprocess.Popen] = {}
    observer = None
    try:
        ips = build_network()
        env = dict(os.environ, OMP_NUM_THREADS="1")

        def spawn(name, args, ns=None):
            prefix = ["ip", "netns", "exec", ns] if ns else []
            with open(tmp / f"{name}.log", "wb") as log:
                procs[name] = subprocess.Popen(prefix + [sys.executable, "-m", "p2pserve.cli", *args], stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True, env=env)

        maddrs_file = tmp / "boot.maddrs"
        spawn("boot", ["bootstrap", "--host-maddrs", f"/ip4/{SUBNET}.1/tcp/0", "--maddrs-file", str(maddrs_file)])
        wait_for(maddrs_file.exists, "bootstrap", 120.0)
        boot = maddrs_file.read_text().split()
        mid = model.spec.model_id
        cfg_path = tmp / "swarm.json"
        write_local_swarm_file(cfg_path, model.spec, boot, "regions", f"/ip4/{SUBNET}.1/tcp/0", TIMING, 1.0)
        spawn("coord", ["coordinator", "--config", str(cfg_path)])
        for ns, ip in ips.items():
            spawn(ns, ["peer", "--model", path, "--config", str(cfg_path), "--host-maddrs", f"/ip4/{ip}/tcp/0",
                       "--num-threads", "1", "--max-layers", "4", "--log-level", "INFO",
                       # in-region links only need to read fast, not exactly: cap their probes' CPU
                       "--probe-max-mb", "4"], ns=ns)
        observer = Swarm.create(DHTConfig(model=mid, swarm_id="regions", initial_peers=tuple(boot),
                                          host_maddrs=(f"/ip4/{SUBNET}.1/tcp/0",), client_mode=True, **TIMING))
        yield dict(observer=observer, model=model, path=path, ips=ips, tmp=tmp)
    finally:
        if observer is not None:
            observer.shutdown()
        for p in procs.values():
            killpg(p)
        tear_down_network()


def region_of(addrs: list[str]) -> str:
    last = int(addrs[0].split("/")[2].rsplit(".", 1)[1])
    return "A" if last < 32 else "B"


def snapshot(observer):
    async def read():
        return await observer.get_plan(), await observer.get_peers(), await observer.get_links()

    return asyncio.run(read())


# A plan unchanged for a little over one plan refresh has outlived a re-plan round. Longer quiet
# periods (6 s) never came on a loaded 2-core CI run, where link readings keep jittering.
QUIET_S = 2.5


def settled_over_measured_links(observer):
    """A poll returning ``(plan, region)`` once the plan is settled over measured links, else None.

    Settled: all four peers serve their targets (no flip pending), every pair's link is measured
    and none is defaulted in the plan, and the plan's epoch has not moved for ``QUIET_S`` (the
    coordinator re-plans within a tick of any link reading that changes by more than 30%, so it
    has seen the current measurements). The flows are not looked at: they are what is asserted.
    """
    seen = {}

    def poll():
        plan, peers, links = snapshot(observer)
        records = {pid: s.record for pid, s in peers.items()}
        region = {pid: region_of(r.addrs) for pid, r in records.items()}
        pairs = [(pid, other) for pid, s in links.items() for other in s.record.links if pid in region and other in region]
        spans = settled_spans(plan.plan, records, 8) if plan is not None and not plan.plan.defaulted_links else None
        if len(records) < 4 or not spans or len(spans) < 4 or len(pairs) < 12:
            seen.clear()
            return None
        since = seen.setdefault(plan.plan.epoch, time.monotonic())
        return (plan.plan, region) if time.monotonic() - since >= QUIET_S else None

    return poll


def flow_inside_and_across(plan, region) -> tuple[float, float]:
    """Tokens/s the plan routes over links inside a region and across regions."""
    flows = [f for f in plan.flows if f.src in region and f.dst in region]
    within = sum(f.rate for f in flows if region[f.src] == region[f.dst])
    return within, sum(f.rate for f in flows) - within


def reprobed_links(observer, region, since: float):
    """A poll returning every link's bandwidth once each has been probed again after ``since``."""
    def poll():
        _, _, links = snapshot(observer)
        fresh = {(pid, other): st.bandwidth for pid, s in links.items() for other, st in s.record.links.items()
                 if pid in region and other in region and st.measured_at > since}
        return fresh if len(fresh) >= 12 else None

    return poll


def test_links_plan_and_generation_across_regions(regions):
    observer, model = regions["observer"], regions["model"]
    expected = RATE_BITS / 8
    # The first placement is made before links are measured; the coordinator re-solves when the
    # measurements arrive. Wait until it has settled on a plan over them, then judge that plan.
    plan, region = wait_for(settled_over_measured_links(observer), "a settled plan over measured links", timeout=300)
    within, across = flow_inside_and_across(plan, region)
    placement = {f"{region[pid]}:{pid[-4:]}": tuple(span) for pid, span in plan.targets.items() if pid in region}
    assert within > across, (within, across, placement)

    # A peer announces each link as the best of its recent probe rounds (a busy host only slows
    # a transfer down). The first rounds ran while four peers were still starting on two cores,
    # so judge the announcement once every link has been probed again since the plan settled.
    pairs = wait_for(reprobed_links(observer, region, time.time()), "every link probed again", timeout=120)
    cross = [bw for (a, b), bw in pairs.items() if region[a] != region[b]]
    inside = [bw for (a, b), bw in pairs.items() if region[a] == region[b]]
    for bw in cross:
        assert 0.7 * expected <= bw <= 1.3 * expected, (bw, expected, sorted(cross))
    assert min(inside) > 3 * expected

    # Generate over the plan as it stands now: it may have moved ranges while links were re-probed.
    def settled_now():
        plan, peers, _ = snapshot(observer)
        spans = settled_spans(plan.plan if plan else None, {p: s.record for p, s in peers.items()}, 8)
        return (spans, peers) if spans else None

    ids = model.chat_ids([{"role": "user", "content": "Hello! How are you today?"}])
    params = GenerationParams(max_new_tokens=12, ignore_eos=True)
    ref = reference_generate(regions["path"], ids, params.max_new_tokens)
    # A fixed chain cannot follow a re-plan, and link readings keep moving on a loaded machine,
    # so a peer may flip to another range mid-generation. A chain refused for a moved range is
    # built again from the plan as it stands then, as a swarm client re-reads the plan
    # (tests/integration/test_failover.py covers that path).
    ours: list[int] = []
    for attempt in range(3):
        spans, peers = wait_for(settled_now, "a settled plan to generate over", timeout=120)
        hops = chain_from_spans(spans, {p: s.record.addrs for p, s in peers.items()}, 8)
        try:
            ours = asyncio.run(run_chain(model, hops, ids, params, 128))
            break
        except GenerationFailedError as e:
            moved = isinstance(e.__cause__, HopFailure) and isinstance(e.__cause__.__cause__, RangeMovedError)
            if not moved or attempt == 2:
                raise
    assert ours[: len(ref)] == ref
