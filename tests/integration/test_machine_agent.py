"""A machine agent (``p2pserve machine --device cpu --slots 2``) regrouped by the coordinator's plan.

``p2pserve bootstrap``, ``p2pserve coordinator --grouping 1`` and one machine agent offering two
CPU slots of 4 layers each of a tiny 8-layer Llama. The agent measures the gloo link between its
slots and announces a signed ``MachineInfo``; the plan groups the machine as 2 x TP-1, the agent
starts both peers and the plan gives them a half each. Then the coordinator stops and a follower with ``--grouping 2`` takes over: the plan
regroups the machine into one TP-2 peer. The agent starts it, retires the two TP-1 peers once it serves, and
stops each only when its layers are served by a peer that is not draining (make-before-break).
An observer checks every half second that the peers serving (draining ones included: they still
answer) cover every layer, and greedy output through the swarm equals `generate` in a generation
started on the two TP-1 peers as the regroup begins and in one after it.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time

import pytest

from p2pserve.client.model_info import LocalModelInfo
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.machine_info import MachineInfo
from p2pserve.launch import Children
from tests.harness import reference_generate
from tests.support import wait_for
from tests.support.swarm import SWARM_DEADLINE, LOOPBACK, _observer, _records, chat_through, start_bootstrap

pytestmark = pytest.mark.integration

NEW_TOKENS = 12
# record lifetimes of 5 s (max-clock-skew): with the by-hand tests' 2 s, records of every peer
# expired at once under load average 20 (refreshes came late), and the plan emptied for a round
TIMING = dict(peer_refresh=1.0, candidate_refresh=0.5, plan_refresh=2.0, link_refresh=2.0, max_clock_skew=5.0)
TIMING_FLAGS = tuple(x for k, v in TIMING.items() for x in (f"--{k.replace('_', '-')}", str(v)))


class CoverageWatch:
    """Polls the peers' records: the fewest peers serving any layer, once every layer was served.

    One DHT read can miss a live record (under load a refresh comes late): a peer counts until it
    withdraws (tombstone) or has been missing for one record lifetime, as the coordinator's
    ``LivePeers`` keeps it."""

    def __init__(self, obs, num_layers: int):
        self.obs, self.L = obs, num_layers
        self.started, self.lowest, self.samples = False, None, 0
        self.seen: dict = {}  # peer id -> (signer, serving, last seen)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        loop = asyncio.new_event_loop()
        while not self._stop.wait(0.5):
            try:
                recs = loop.run_until_complete(self.obs.get_peers())
            except Exception:
                continue
            now = time.monotonic()
            for pid, s in recs.items():
                self.seen[pid] = (s.signer, s.record.serving, now)
            gone = self.obs.withdrawn.get(RecordKind.PEERS, set())
            cover = [0] * self.L
            for pid, (signer, serving, at) in list(self.seen.items()):
                if signer in gone or now - at > self.obs.config.peer_ttl:
                    del self.seen[pid]
                elif serving is not None:
                    for layer in range(*serving):
                        cover[layer] += 1
            self.started = self.started or min(cover) > 0
            if self.started:
                self.samples += 1
                self.lowest = min(cover) if self.lowest is None else min(self.lowest, min(cover))
        loop.close()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)


def test_machine_agent_regroups_two_tp1_into_one_tp2_without_uncovering_a_layer(model_dir, tmp_path):
    path = model_dir("llama")
    model = LocalModelInfo.load(path)
    name, L = model.spec.model_id, model.spec.num_layers
    ids = model.chat_ids([{"role": "user", "content": "Hello, swarm started by hand!"}])
    ref = reference_generate(path, ids, NEW_TOKENS)
    children = Children(tmp_path)
    obs = None
    try:
        boot = start_bootstrap(children, tmp_path)
        coord = ("coordinator", "--model", path, "--initial-peers", *boot, "--host-maddrs", LOOPBACK,
                 "--solve-time-limit", "0.5", *TIMING_FLAGS)
        children.start("coord1", *coord, "--grouping", "1", "--priority", "1")
        children.start("coord2", *coord, "--grouping", "2")  # a follower until coord1 stops
        children.start("machine", "machine", "--model", path, "--initial-peers", *boot, "--host-maddrs", LOOPBACK,
                       "--device", "cpu", "--slots", "2", "--slot-max-layers", "4", "--logdir", str(tmp_path),
                       *TIMING_FLAGS)
        obs = _observer(boot, name, L, **TIMING)

        def machine():
            found = asyncio.run(obs.read(RecordKind.MACHINES, MachineInfo))
            return found[0].record if found else None

        info = wait_for(machine, "the machine's announcement", SWARM_DEADLINE, interval=0.5, children=children)
        assert len(info.gpus) == 2 and len(info.links) == 1 and info.tp_degrees == [2]
        assert info.links[0].bandwidth > 0 and len(info.gpus[0].throughput_decode) == 4

        def grouped(degrees):
            def check():
                signed = asyncio.run(obs.get_plan())
                recs = _records(obs)
                serving = {pid: r for pid, r in recs.items() if r.serving is not None and r.state == "serving"}
                ok = (signed is not None and signed.plan.groupings.get(info.machine_id) == degrees
                      and sorted(r.tp for r in serving.values()) == sorted(degrees)
                      and len(recs) == len(degrees) and min(signed.plan.coverage()) > 0)
                return serving if ok else None
            return check

        wait_for(grouped([1, 1]), "2 x TP-1 serving every layer", SWARM_DEADLINE, interval=0.5, children=children)

        with CoverageWatch(obs, L) as watch:
            # a generation that starts on the two TP-1 peers while the machine regroups
            during = []
            t = threading.Thread(target=lambda: during.append(chat_through(boot, path).tokens), daemon=True)
            t.start()
            children.procs.pop("coord1").stop()  # not a failure: coord2, grouping by 2, takes over
            serving = wait_for(grouped([2]), "1 x TP-2 serving every layer", SWARM_DEADLINE, interval=0.5, children=children)
            t.join(120)
        (tp2,) = serving.values()
        assert tuple(tp2.serving) == (0, L) and tp2.device == "cpu x2"
        assert during == [ref]
        assert chat_through(boot, path).tokens == ref
        assert watch.samples > 0 and watch.lowest >= 1, (watch.samples, watch.lowest)
        log = (tmp_path / "machine.log").read_text()
        assert "retiring the group on slots [0]" in log and "its layers are served elsewhere" in log
    except BaseException:
        for n, child in children.procs.items():
            print(f"--- {n}\n{child.output(3000)}")
        for f in sorted(tmp_path.glob("group-*.log")):
            print(f"--- {f.name}\n{f.read_text()[-3000:]}")
        raise
    finally:
        if obs is not None:
            obs.shutdown()
        children.stop_all(timeout=30)  # the agent stops its groups (20 s grace) before it exits
        _kill_groups(tmp_path / "machine.log")


def _kill_groups(log_path):
    """The group peers run in sessions of their own: kill any the agent left (it was SIGKILLed)."""
    for pid in re.findall(r"group on slots \[[\d, ]+\] \(pid (\d+)\)", log_path.read_text() if log_path.exists() else ""):
        try:
            if b"p2pserve.cli\x00peer" in open(f"/proc/{pid}/cmdline", "rb").read():  # not a reused pid
                os.killpg(int(pid), signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
