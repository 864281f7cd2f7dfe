"""Fake service reports cannot zero an honest peer's flow; probes work in a ``--swarm-model`` swarm.

Real processes on loopback: a bootstrap node, a coordinator and two real peers of the tiny Llama,
every member naming the swarm with ``--swarm-model`` (a name that is not the checkpoint's id: the
coordinator knows the model only by it, and opens its compute probes with the model id each peer
announces). Two ``ServiceReports`` records from two fresh keys, each at a made-up address,
report one peer at rate 0: once the coordinator has probed both peers, its own probe wins over
them; in a cold swarm (probes off) they carry no receipt of the victim and count for nothing.
Either way the victim keeps its share of the plan's flow.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from p2pserve.cli.common import write_local_swarm_file
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.config import DHTConfig
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.records import encode_record
from p2pserve.dht.reports import ObservedRate, ServiceReports
from p2pserve.dht.swarm import Swarm
from p2pserve.launch import Children, PeerProcess

pytestmark = pytest.mark.integration

SWARM = "not-the-checkpoint-id"
TIMING = dict(peer_refresh=0.5, candidate_refresh=0.5, plan_refresh=1.0, link_refresh=5.0, max_clock_skew=2.0)
DEADLINE = 120.0


def _until(fn, what: str):
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        value = fn()
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"timed out waiting for {what}")


@pytest.mark.parametrize("probe_interval", ["3", "0"], ids=["probed", "cold"])
def test_fake_reports_do_not_zero_a_peer(model_dir, tmp_path, probe_interval):
    """Probed: the coordinator's own probe wins over the fake reports. Cold (probes off, so no
    measurement of its own): the fake reporters were never served by the victim, so they hold no
    receipt of it and their reports are ignored (before: the victim's flow went to 0)."""
    path = model_dir("llama")
    spec = LocalModelInfo.load(path).spec
    children = Children(tmp_path)
    peers, nodes = [], []
    loop = asyncio.new_event_loop()
    try:
        maddrs_file = tmp_path / "boot.maddrs"
        children.start("boot", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--maddrs-file", str(maddrs_file))
        _until(maddrs_file.exists, "the bootstrap node")
        boot = maddrs_file.read_text().split()
        cfg = tmp_path / "swarm.json"
        write_local_swarm_file(cfg, spec, boot, "fake-reports", "/ip4/127.0.0.1/tcp/0", TIMING, 0.5)
        children.start("coord", "coordinator", "--config", str(cfg), "--swarm-model", SWARM,
                       "--compute-probe-interval", probe_interval, "--replan-period", "2",
                       "--log-level", "INFO")  # re-planned with the reports readable
        peers = [PeerProcess.launch(path, (0, 8), "--config", str(cfg), "--swarm-model", SWARM) for _ in range(2)]
        for p in peers:
            p.wait_ready(DEADLINE)
        victim = peers[0].peer_id
        dht = DHTConfig(model=SWARM, swarm_id="fake-reports", initial_peers=tuple(boot),
                        host_maddrs=("/ip4/127.0.0.1/tcp/0",), client_mode=True, **TIMING)
        reader = Swarm.create(dht)
        nodes.append(reader)

        def probed_both():  # the coordinator's own report names both peers: its probes succeed here
            reports = loop.run_until_complete(reader.read(RecordKind.REPORTS, ServiceReports))
            return any({r.peer_id for r in s.record.rates} >= {p.peer_id for p in peers} for s in reports)

        if probe_interval != "0":
            _until(probed_both, "the coordinator's compute probes of both peers")

        def victim_share():
            sp = loop.run_until_complete(reader.get_plan())
            if sp is None:
                return None
            flows = [f for f in sp.plan.flows if f.src in {p.peer_id for p in peers}]
            total = sum(f.rate for f in flows)
            return sum(f.rate for f in flows if f.src == victim) / total if total > 0 else None

        before = _until(victim_share, "a plan with flow")
        for i in (1, 2):
            fake = Swarm.create(dht)
            nodes.append(fake)
            record = ServiceReports(model=SWARM, reporter_id=fake.peer_id, addrs=[f"/ip4/198.51.100.{i}/tcp/4000"],
                                    rates=[ObservedRate(peer_id=victim, layers=8, samples=64, rate=0.0,
                                                        wall_rate=0.0, observed_at=time.time())],
                                    timestamp=time.time())
            assert loop.run_until_complete(fake._put(RecordKind.REPORTS, encode_record(record), 300))
        time.sleep(8.0)  # several coordinator rounds with the fake reports readable
        after = _until(victim_share, "a plan with flow")
        assert before > 0.2 and after > 0.2, (before, after)
        log = (tmp_path / "coord.log").read_text(errors="replace")
        assert "unknown_model" not in log and "serves model" not in log
    finally:
        for node in nodes:
            node.shutdown()
        for p in peers:
            p.kill()
        children.stop_all(timeout=0)
        loop.close()
