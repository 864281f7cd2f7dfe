"""The decode estimate checked against the simulator on held-back placements, in a
small window: the report exists, covers placements the fit never saw, and ranks them."""

from __future__ import annotations

import math

import pytest

from p2pserve.helix import format as hf
from p2pserve.helix.root import data_root
from p2pserve.placement.calibration import error_report, held_back_placements, perturbations, spearman
from p2pserve.placement.estimate import estimate
from p2pserve.placement.heuristics import petals_greedy
from p2pserve.placement.solution import validate_placement
from p2pserve.sim.plan_check import simulated_decode


def test_spearman_and_error_report():
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2], [5, 5, 9]) == pytest.approx(1.0)  # ties share ranks
    rep = error_report([("a", 110.0, 100.0), ("b", 45.0, 50.0), ("c", 1.0, 0.0)])
    assert rep.n == 2  # a zero reference is skipped
    assert rep.mean_abs_rel == pytest.approx(0.1)
    assert rep.max_abs_rel == pytest.approx(0.1)
    assert rep.bias == pytest.approx(0.0)
    assert error_report([]).n == 0


def test_perturbations_are_valid_and_distinct(cluster24):
    base = petals_greedy(cluster24)
    out = perturbations(cluster24, base, 4, 3, seed=5)
    assert len(out) == 4
    assert all(not validate_placement(cluster24, p) and p != base for p in out)
    assert perturbations(cluster24, base, 4, 3, seed=5) == out  # seeded


def test_estimate_against_simulator_small_window(cluster24):
    """Held-back placements of cluster24 (heuristics, chains, tiered starts, perturbations of
    Petals), simulated for 30 s after a 15 s warm-up at simulator seed 1: the report is finite
    and the estimate orders them better than chance."""
    cluster = hf.load_cluster(data_root() / "clusters/single_cluster/cluster24.ini")
    held = held_back_placements(cluster24, {"petals": petals_greedy(cluster24)}, per_plan=2, seed=3)
    assert {"swarm", "separate", "balanced_chain", "petals~0"} <= set(held)
    rows = [(n, estimate(cluster24, p).decode_tokens_per_s,
             simulated_decode(cluster, "llama2-70b", p, duration=30.0, warmup=15.0, seed=1)) for n, p in held.items()]
    rep = error_report(rows)
    assert rep.n == len(held)
    assert math.isfinite(rep.mean_abs_rel) and rep.max_abs_rel >= rep.mean_abs_rel
    assert rep.spearman > 0.3
