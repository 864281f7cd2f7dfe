"""Checking the decode estimate against a reference (the simulator) on held-back placements.

The estimate's constants (:class:`~p2pserve.placement.estimate.WorkloadModel`) were fitted on
cluster24 placements. Whether they transfer is a measurement, not an assumption: this module
builds placements the fit never saw (heuristics, chains, tiered starts, plans and random
perturbations of them, on any cluster) and summarises the estimate's error against whatever
reference the caller measured (``benchmarks/planner_estimate.py`` simulates them). Pure: the
reference comes in as numbers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Mapping, Sequence

from p2pserve.placement.heuristics import all_heuristics
from p2pserve.placement.search import _neighbour, balanced_chain, tiered_candidates
from p2pserve.placement.solution import validate_placement
from p2pserve.placement.topology import Topology

Placement = dict[int, tuple[int, int]]


@dataclass(frozen=True)
class ErrorReport:
    """Estimate against reference over ``n`` placements.

    ``mean_abs_rel`` / ``max_abs_rel``: |estimate / reference - 1|; ``bias``: mean of the signed
    ratio minus one (positive: the estimate is optimistic); ``spearman``: rank correlation
    (what the search needs: it only compares placements); ``worst``: the placement with the
    largest error.
    """

    n: int
    mean_abs_rel: float
    max_abs_rel: float
    bias: float
    spearman: float
    worst: str


def perturbations(topo: Topology, placement: Mapping[int, tuple[int, int]], count: int, moves: int,
                  seed: int) -> list[Placement]:
    """``count`` valid placements, each ``moves`` random search moves away from ``placement``."""
    rng = random.Random(seed)
    movable = list(range(topo.num_nodes))
    out: list[Placement] = []
    for _ in range(count * 20):
        if len(out) >= count:
            break
        q: Placement = dict(placement)
        for _m in range(moves):
            q = _neighbour(topo, q, rng, movable) or q
        if q != placement and not validate_placement(topo, q) and q not in out:
            out.append(q)
    return out


def held_back_placements(topo: Topology, plans: Mapping[str, Mapping[int, tuple[int, int]]],
                         per_plan: int = 3, moves: int = 4, seed: int = 0) -> dict[str, Placement]:
    """Placements to check the estimate on, by name: the heuristic baselines, the balanced
    chain, the two best-spread tiered candidates, ``plans`` (e.g. our plans at seeds other than
    the fit's) and ``per_plan`` perturbations of each plan. Invalid ones are left out."""
    out: dict[str, Placement] = {k: dict(v) for k, v in all_heuristics(topo).items()}
    out["balanced_chain"] = balanced_chain(topo)
    tiers = tiered_candidates(topo)
    for j, p in enumerate(tiers[:: max(1, len(tiers) // 2)][:2]):
        out[f"tiered{j}"] = p
    for name, p in plans.items():
        out[name] = dict(p)
        # the seed's j is the previous loop's (kept as it is: it fixes the published calibration)
        for j, q in enumerate(perturbations(topo, p, per_plan, moves, seed + j)):  # pyright: ignore[reportPossiblyUnboundVariable]
            out[f"{name}~{j}"] = q
    return {k: v for k, v in out.items() if v and not validate_placement(topo, v)}


def _ranks(xs: Sequence[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for t in range(i, j + 1):
            ranks[order[t]] = (i + j) / 2.0  # ties share their mean rank
        i = j + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation of two equal-length samples (NaN below 2 points or no spread)."""
    if len(a) < 2:
        return float("nan")
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / (va * vb) ** 0.5 if va > 0 and vb > 0 else float("nan")


def error_report(rows: Sequence[tuple[str, float, float]]) -> ErrorReport:
    """Summarise ``(name, estimate, reference)`` rows (rows with a reference <= 0 are skipped)."""
    rows = [r for r in rows if r[2] > 0]
    if not rows:
        nan = float("nan")
        return ErrorReport(0, nan, nan, nan, nan, "")
    rel = [e / s - 1.0 for _, e, s in rows]
    worst = max(range(len(rows)), key=lambda i: abs(rel[i]))
    return ErrorReport(
        n=len(rows),
        mean_abs_rel=sum(abs(x) for x in rel) / len(rel),
        max_abs_rel=abs(rel[worst]),
        bias=sum(rel) / len(rel),
        spearman=spearman([r[1] for r in rows], [r[2] for r in rows]),
        worst=rows[worst][0],
    )
