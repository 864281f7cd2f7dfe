"""The coordinator's compute probes (coordinator/compute_probe.py) and their weight in claims.py."""

from __future__ import annotations

import pytest

from p2pserve.config import CoordinatorConfig
from p2pserve.coordinator import claims
from p2pserve.coordinator.compute_probe import ComputeProber, due, rate_from
from p2pserve.config import ComputeProbeConfig
from p2pserve.dht.records import MAX_TOKENS_PER_S, PeerInfo
from p2pserve.dht.reports import ObservedRate, ServiceReports

CFG = CoordinatorConfig(num_layers=8, activation_bytes=1000, solve_time_limit=0.3)


def peer(pid, tps=50.0, serving=(0, 8), state="serving"):
    return PeerInfo(model="m", peer_id=pid, max_layers=8, throughput_decode=[tps / j for j in range(1, 9)],
                    serving=serving, state=state)


def probe(reporter, pid, per_session, layers=8, samples=8):
    rate = ObservedRate(peer_id=pid, layers=layers, samples=samples, rate=per_session, wall_rate=per_session,
                        observed_at=1.0)
    return ServiceReports(model="m", reporter_id=reporter, rates=[rate], timestamp=1.0)


def test_rate_takes_the_link_out_at_most_max_rtt_credit_fold():
    rate, wall_rate = rate_from(0.01, [0.02, 0.03, 0.02], 4.0)
    assert wall_rate == pytest.approx(50.0) and rate == pytest.approx(100.0)
    rate, wall_rate = rate_from(0.0199, [0.02] * 3, 4.0)  # a peer stalling its OpenSession to look fast
    assert rate == pytest.approx(4 * wall_rate)


def test_each_serving_peer_is_due_once_per_interval_the_longest_waiting_first():
    peers = {p.peer_id: p for p in (peer("a"), peer("b"), peer("c"), peer("j", serving=None, state="joining"),
                                   peer("d", state="draining"))}
    assert due(peers, {}, 100.0, 60.0) == ["a", "b", "c"]  # not joining, not draining
    assert due(peers, {"a": 90.0, "b": 10.0}, 100.0, 60.0) == ["c", "b"]


def test_one_trusted_probe_caps_a_liar_with_no_client_report():
    honest = {"h": peer("h")}  # with one honest peer, the cold swarm's median claim is the liar's half
    peers = {**honest, "liar": peer("liar", tps=MAX_TOKENS_PER_S)}
    # a one-layer claim of 50 at batch 32 over 8 layers is 50 / 8 / 32 tokens/s per session
    reports = [probe("coord", pid, 50 / 8 / 32) for pid in peers]
    untrusted = claims.verdicts(peers, reports, CFG)  # one reporter: not enough on its own
    assert untrusted["liar"].reason == "cold" and not untrusted["liar"].capped
    found = claims.verdicts(peers, reports, CFG, trusted=frozenset({"coord"}))
    liar = found["liar"]
    assert liar.reason == "probed" and liar.effective == pytest.approx(2 * 50.0)  # claim_slack x what it serves
    assert "compute probe saw" in liar.describe()
    assert not any(found[pid].capped for pid in honest)


def test_clients_cannot_vouch_a_liar_above_what_the_probe_saw():
    peers = {"h": peer("h"), "liar": peer("liar", tps=MAX_TOKENS_PER_S)}
    vouch = [ServiceReports(model="m", reporter_id=f"c{i}", addrs=[f"/ip4/192.0.2.{i}/tcp/1"], timestamp=1.0,
                            rates=[ObservedRate(peer_id="liar", layers=8, samples=32, rate=1e6, wall_rate=1e6)])
             for i in (1, 2)]
    found = claims.verdicts(peers, vouch + [probe("coord", "liar", 50 / 8 / 32)], CFG, trusted=frozenset({"coord"}))
    assert found["liar"].reason == "probed" and found["liar"].effective == pytest.approx(100.0)
    assert "compute probe" in found["liar"].describe()


def test_fake_reports_cannot_defame_a_peer_below_what_the_probe_saw():
    """Two report records from fresh keys at made-up addresses say an honest peer serves nothing:
    the coordinator's own probe measured it, and the probe wins."""
    peers = {"h": peer("h"), "victim": peer("victim")}
    defame = [ServiceReports(model="m", reporter_id=f"c{i}", addrs=[f"/ip4/198.51.100.{i}/tcp/1"], timestamp=1.0,
                             rates=[ObservedRate(peer_id="victim", layers=8, samples=64, rate=0.0, wall_rate=0.0)])
              for i in (1, 2)]
    found = claims.verdicts(peers, defame + [probe("coord", "victim", 50 / 8 / 32)], CFG, trusted=frozenset({"coord"}))
    assert found["victim"].reason == "probed" and not found["victim"].capped


def test_the_report_holds_fresh_results_only():
    prober = ComputeProber(None, "m", ComputeProbeConfig(max_age_s=60.0))
    from p2pserve.clock import wall

    prober.results = {"a": ObservedRate(peer_id="a", layers=2, samples=8, rate=3.0, wall_rate=2.0, observed_at=wall()),
                      "b": ObservedRate(peer_id="b", layers=2, samples=8, rate=3.0, wall_rate=2.0, observed_at=1.0)}
    rec = prober.report("coord", "m", [])
    rec.validate()
    assert [r.peer_id for r in rec.rates] == ["a"]
