"""Solve the placement MILP: build it, warm-start it, hand it to a backend, read the placement."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping

from p2pserve.placement.maxflow import max_flow
from p2pserve.placement.milp.backends import SolveSettings, solve
from p2pserve.placement.milp.model import (
    MilpOptions,
    build_model,
    canonical_for_symmetry,
    read_placement,
    solution_vector,
)
from p2pserve.placement.topology import Topology


@dataclass
class MilpResult:
    """Outcome of a MILP solve."""

    placement: dict[int, tuple[int, int]] | None
    objective: float
    bound: float
    gap: float
    status: str
    solve_time_s: float
    backend: str
    num_vars: int
    num_rows: int
    trace: list[tuple[float, float]] = field(default_factory=list)  # (seconds, incumbent)


def solve_milp(
    topo: Topology,
    time_limit_s: float,
    opts: MilpOptions = MilpOptions(),
    warm_starts: list[Mapping[int, tuple[int, int]]] | None = None,
    backend: str = "auto",
    upper_bound: float | None = None,
) -> MilpResult:
    """Build and solve the MILP. ``backend``: ``auto`` (Gurobi if fully licensed, else CP-SAT if
    installed, else HiGHS), ``highs``, ``gurobi``, ``cpsat``. Warm starts must place every node
    (complete placements); others are skipped."""
    pm = build_model(topo, opts)
    starts = []
    for p in warm_starts or []:
        fits = all(
            i in p and 0 <= p[i][0] < p[i][1] <= topo.num_layers and (p[i][1] - p[i][0]) in pm.b[i]
            for i in range(topo.num_nodes)
        )
        if fits:  # the MILP needs every node placed within its memory
            q = canonical_for_symmetry(topo, p) if opts.symmetry else dict(p)
            starts.append(solution_vector(pm, topo, q, opts.partial))
    ub = upper_bound if upper_bound is not None else topo.upper_bound()
    target = (1.0 - opts.early_stop_gap) * ub if opts.early_stop_gap > 0 else None
    t0 = time.monotonic()
    res = solve(pm.model, time_limit_s, starts, backend, SolveSettings(opts.threads, opts.seed, target))
    elapsed = time.monotonic() - t0
    placement = read_placement(pm, topo, res.x) if res.x is not None else None
    obj = max_flow(topo, placement, opts.partial).value if placement else 0.0
    bound = res.bound
    gap = (bound - obj) / bound if bound and bound > 0 and bound != float("inf") else float("nan")
    return MilpResult(
        placement, obj, bound, gap, res.status, elapsed, res.backend,
        pm.model.num_vars, pm.model.num_rows, res.trace,
    )
