"""Chaos with real processes: a bootstrap node, two coordinators and five plan-driven peers on a
seeded tiny fp32 Llama; eight chat clients; peers SIGKILLed and restarted, frozen (SIGSTOP) and
woken, the elected coordinator killed and restarted; a hostile participant attacking live peers.

The run (``tests/chaos/driver.py``) lasts at least 60 s and until at least 20 faults were
injected. Asserted, counts and equality only: no request lost (a request that raised to the
client despite its own failover; nothing retries at the application level), every reply
token-identical to single-process ``generate``, no peer whose compute thread died or was
restarted, and every kind of attack sent. ``python benchmarks/chaos.py --minutes M`` runs the
same driver for longer and writes the whole report.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from tests.chaos.driver import ChaosConfig, run_chaos
from tests.chaos.hostile import ATTACKS

pytestmark = pytest.mark.integration


def test_chaos_loses_no_request_and_every_reply_is_identical(tmp_path):
    torch.set_num_threads(1)  # the references run in this process; the cores are shared
    report = asyncio.run(run_chaos(ChaosConfig(workdir=tmp_path, min_chaos_s=60.0, min_faults=20)))
    (tmp_path / "report.json").write_text(json.dumps(report, indent=1, default=str))
    requests, faults, compute = report["requests"], report["faults"], report["compute"]
    summary = json.dumps({k: report[k] for k in ("requests", "attacks", "compute")}, default=str)[:4000]
    assert faults["total"] >= 20, faults
    assert set(faults["by_kind"]) == {"kill_peer", "stop_peer", "kill_leader"}, faults
    assert requests["completed"] > 0 and requests["lost"] == 0, summary
    assert requests["identical"] == requests["completed"], summary
    assert compute["dead_threads"] == 0 and not compute["not_answering_at_end"], compute
    assert set(report["attacks"]["sent"]) == set(ATTACKS), report["attacks"]
