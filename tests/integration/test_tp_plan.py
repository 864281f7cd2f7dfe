"""A plan-driven tensor-parallel peer (``--tp 2``, no ``--layers``) in a real swarm.

``p2pserve bootstrap``, ``p2pserve coordinator --model PATH`` and two plan-driven peers with
``--max-layers 4`` on a tiny 8-layer Llama: a TP-2 group and a TP-1 peer. The coordinator's plan
gives each half the model; greedy output through the swarm equals `generate`. Then the
coordinator stops and a second coordinator (this test's own DHT node, a real signed Plan of a
higher epoch) swaps the two ranges: the TP group loads its new range while the old one keeps
serving, hands over (make-before-break, ``peer/handover.py``) and the swapped route still
matches `generate`. The test publishes the second plan itself because which half the planner
gives the TP peer first is the planner's choice; the swap moves it whichever half it got.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from p2pserve.client.hop import Hop
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.client.params import GenerationParams
from p2pserve.dht.records import CoordinatorCandidate, Plan
from p2pserve.launch import Children
from tests.harness import reference_generate, run_chain
from tests.support import wait_for
from tests.support.swarm import SWARM_DEADLINE, LOOPBACK, TIMING_FLAGS, _observer, _records, chat_through, start_bootstrap

pytestmark = pytest.mark.integration

GREEDY = GenerationParams(max_new_tokens=12, ignore_eos=True)
PEER_FLAGS = ("--device", "cpu", "--host-maddrs", LOOPBACK, "--num-threads", "1", "--max-layers", "4",
              "--profile-batch", "4", *TIMING_FLAGS)


def _serving(obs, want: dict[str, tuple[int, int]]):
    recs = _records(obs)
    ok = all(pid in recs and recs[pid].serving is not None and tuple(recs[pid].serving) == span
             and recs[pid].state == "serving" for pid, span in want.items())
    return recs if ok else None


def test_plan_driven_tp_peer_serves_and_moves(model_dir, tmp_path):
    path = model_dir("llama")
    model = LocalModelInfo.load(path)
    name, L = model.spec.model_id, model.spec.num_layers
    children = Children(tmp_path)
    obs = None
    try:
        boot = start_bootstrap(children, tmp_path)
        children.start("coord", "coordinator", "--model", path, "--initial-peers", *boot, "--host-maddrs", LOOPBACK,
                       "--solve-time-limit", "0.5", *TIMING_FLAGS)
        children.start("tp2", "peer", "--model", path, "--initial-peers", *boot, "--tp", "2", *PEER_FLAGS)
        children.start("tp1", "peer", "--model", path, "--initial-peers", *boot, *PEER_FLAGS)
        obs = _observer(boot, name, L)

        def two_halves():
            signed = asyncio.run(obs.get_plan())
            recs = _records(obs)
            if signed is None or len(signed.plan.spans) < 2 or min(signed.plan.coverage()) < 1:
                return None
            return (signed.plan, recs) if {r.tp for r in recs.values()} == {1, 2} else None

        plan, recs = wait_for(two_halves, "a plan serving every layer on both peers", SWARM_DEADLINE, interval=0.5, children=children)
        tp2 = next(pid for pid, r in recs.items() if r.tp == 2)
        tp1 = next(pid for pid, r in recs.items() if r.tp == 1)
        assert recs[tp2].device == "cpu x2" and tuple(plan.targets[tp2]) == tuple(recs[tp2].serving)
        ids = model.chat_ids([{"role": "user", "content": "Hello, swarm started by hand!"}])
        ref = reference_generate(path, ids, GREEDY.max_new_tokens)
        assert chat_through(boot, path).tokens == ref  # routed by the coordinator's plan

        # a new plan moves the TP group: the ranges swap
        children.procs.pop("coord").stop()  # not a failure: the next plan comes from elsewhere
        old = {tp2: tuple(recs[tp2].serving), tp1: tuple(recs[tp1].serving)}
        new = {tp2: old[tp1], tp1: old[tp2]}
        swap = Plan(model=name, epoch=plan.epoch + 1, leader_id=obs.peer_id, num_layers=L, targets=new, spans=old,
                    created_at=time.time(), reason="test: swap the halves")
        # an open swarm follows only the elected candidate's plans: the observer stands, first in line
        asyncio.run(obs.announce_candidate(CoordinatorCandidate(model=name, coordinator_id=obs.peer_id, priority=10,
                                                                start_time=time.time(), public_key=obs.public_key)))
        asyncio.run(obs.publish_plan(swap))
        recs = wait_for(lambda: _serving(obs, new), "both peers serving the swapped halves", SWARM_DEADLINE, interval=0.5, children=children)
        hops = sorted((Hop(pid, *new[pid], tuple(recs[pid].addrs)) for pid in new), key=lambda h: h.start)
        assert asyncio.run(run_chain(model, hops, ids, GREEDY)) == ref
        log = (tmp_path / "tp2.log").read_text()
        assert "handover to" in log and f"now serving [{new[tp2][0]}, {new[tp2][1]})" in log
    except BaseException:
        for n, child in children.procs.items():
            print(f"--- {n}\n{child.output(3000)}")
        raise
    finally:
        if obs is not None:
            obs.shutdown()
        children.stop_all(timeout=5)
