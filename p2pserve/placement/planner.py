"""The placement planner: topology in, :class:`~p2pserve.placement.solution.Solution` out.

Pure: no network, no simulator. Pipeline (ARCHITECTURE.md, "The planner"):

1. check memory (:class:`InsufficientMemoryError` says how much is missing);
2. candidate placements: Petals-greedy, Swarm-even, separate pipelines, the balanced chain and
   the current plan (for re-solves);
3. improve them: annealing on max-flow (objective ``max-flow``) or on the depth/KV-aware decode
   estimate (objective ``throughput``, the default); for ``max-flow`` the MILP then gets the
   rest of the time, warm-started with the best placement, to raise it or prove a bound;
4. give idle nodes a range where it helps (:func:`fill_idle`) and report flows, max-flow,
   bounds, gap, depth, latency and decode estimates (:func:`make_solution`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Mapping

from p2pserve.errors import ConfigError, PlanningError
from p2pserve.placement.estimate import WorkloadModel, estimate
from p2pserve.placement.guard import Check, guard
from p2pserve.placement.refine import refine
from p2pserve.placement.heuristics import all_heuristics
from p2pserve.placement.maxflow import max_flow
from p2pserve.placement.milp.model import MilpOptions
from p2pserve.placement.milp.solve import MilpResult, solve_milp
from p2pserve.placement.search import balanced_chain, improve, max_flow_score, tiered_candidates
from p2pserve.placement.solution import Solution, check_memory, validate_placement
from p2pserve.placement.topology import Topology

OBJECTIVES = ("throughput", "max-flow")
#: Clusters up to this many nodes are solved MILP-first (exact within seconds).
SMALL_CLUSTER = 8


@dataclass(frozen=True)
class PlannerConfig:
    """Planner settings.

    ``objective``: ``throughput`` (decode estimate, default) or ``max-flow`` (Helix's).
    ``time_limit_s``: wall-clock budget for the whole solve. ``partial``: allow a hop to start
    mid-range (Helix partial inference). ``use_milp``: give part of a ``max-flow`` solve to the
    MILP (HiGHS by default; ``backend`` picks another). ``milp_share``: that part.
    ``early_stop_gap``: stop once within this fraction of the upper bound. ``max_depth`` /
    ``max_latency_s``: reject placements whose flow paths are deeper / slower (throughput
    objective). ``seed``: search seed. ``work``: the search's budget in score evaluations; when
    set, the same inputs and seed give the same placement on any machine, however loaded, and
    ``time_limit_s`` is only an outer safety limit (``stats["search"]["stopped_by"]`` says
    ``"time"`` if it fired first). With ``work`` the max-flow objective gives the MILP only to
    small clusters, where it is exact. ``refine_checks``: when ``plan_for_topology`` is given a
    check, climb on it for this many checks from the guard's choice (:mod:`refine`; 0: guard only).
    ``challengers``: how many of the estimate's best tiered candidates the guard also checks.
    """

    objective: str = "throughput"
    time_limit_s: float = 60.0
    partial: bool = True
    use_milp: bool = True
    milp_share: float = 0.25
    backend: str = "auto"
    early_stop_gap: float = 0.001
    max_depth: int | None = None
    max_latency_s: float | None = None
    seed: int = 0
    work: int | None = None
    refine_checks: int = 0
    challengers: int = 3
    workload: WorkloadModel = field(default_factory=WorkloadModel)

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"objective must be one of {OBJECTIVES}, not {self.objective!r}")
        if self.time_limit_s <= 0:
            raise ConfigError("time limit must be positive")
        if self.work is not None and self.work < 1:
            raise ConfigError("work (evaluations) must be at least 1")


def throughput_score(
    topo: Topology, config: PlannerConfig, extra: Callable[[Mapping[int, tuple[int, int]]], float] | None = None
) -> Callable[[dict[int, tuple[int, int]]], float]:
    """Score for the throughput objective: estimated decode tokens/s (limits as penalties).

    A small max-flow term breaks ties (between equal estimates, prefer more headroom).
    """

    def score(p: dict[int, tuple[int, int]]) -> float:
        fr = max_flow(topo, p, config.partial)
        if fr.value <= 0:
            return -1e9 + fr.value
        est = estimate(topo, p, fr, config.workload, config.partial)
        v = est.decode_tokens_per_s + 1e-4 * fr.value
        if config.max_depth is not None and est.max_depth > config.max_depth:
            v -= 1e3 * (est.max_depth - config.max_depth)
        if config.max_latency_s is not None and est.per_token_latency_s > config.max_latency_s:
            v -= 1e3 * (est.per_token_latency_s - config.max_latency_s)
        if extra is not None:
            v += extra(p)
        return v

    return score


def fill_idle(
    topo: Topology, placement: Mapping[int, tuple[int, int]], score: Callable[[dict[int, tuple[int, int]]], float]
) -> dict[int, tuple[int, int]]:
    """Give idle nodes a range where it helps ``score`` most (never hurts: kept only if better).

    Nodes in index order; each tries sizes 1, half and all of its memory at starts spaced by
    half the size, and keeps the best range that raises the score.
    """
    out = dict(placement)
    base = score(out)
    L = topo.num_layers
    for i in range(topo.num_nodes):
        if i in out or topo.nodes[i].max_layers <= 0:
            continue
        best = None
        for k in sorted({1, max(1, topo.nodes[i].max_layers // 2), topo.nodes[i].max_layers}):
            k = min(k, L)
            for s in range(0, L - k + 1, max(1, k // 2)):
                cand = dict(out)
                cand[i] = (s, s + k)
                v = score(cand)
                if v > base + 1e-9 and (best is None or v > best[0]):
                    best = (v, (s, s + k))
        if best is not None:
            out[i] = best[1]
            base = best[0]
    return out


def make_solution(
    topo: Topology,
    placement: Mapping[int, tuple[int, int]],
    config: PlannerConfig,
    solve_time_s: float,
    method: str,
    solver_bound: float | None = None,
    stats: dict | None = None,
) -> Solution:
    """Wrap a placement into a :class:`Solution` with flows, bounds and estimates."""
    placement = {i: (r[0], r[1]) for i, r in placement.items()}
    fr = max_flow(topo, placement, config.partial)
    est = estimate(topo, placement, fr, config.workload, config.partial)
    ub = topo.upper_bound()
    cover = topo.covering_upper_bound()
    bound = min(x for x in (ub, cover, solver_bound) if x is not None and x > 0) if (ub > 0) else 0.0
    gap = (bound - fr.value) / bound if bound > 0 else float("nan")
    warnings = list(validate_placement(topo, placement))
    if config.max_depth is not None and est.max_depth > config.max_depth:
        warnings.append(f"depth limit {config.max_depth} not met: deepest flow path has {est.max_depth} hops")
    if config.max_latency_s is not None and est.per_token_latency_s > config.max_latency_s:
        warnings.append(
            f"latency limit {config.max_latency_s:.3f} s not met: estimate {est.per_token_latency_s:.3f} s"
        )
    if topo.missing_links:
        warnings.append(f"{len(topo.missing_links)} links unmeasured; conservative defaults used")
    return Solution(
        assignments=dict(sorted(placement.items())),
        node_names={i: topo.nodes[i].name for i in range(topo.num_nodes)},
        flows=dict(fr.edge_flows),
        max_flow=fr.value,
        upper_bound=ub,
        covering_bound=cover,
        solver_bound=bound,
        solver_gap=max(0.0, gap),
        solve_time_s=solve_time_s,
        objective=config.objective,
        method=method,
        estimate=est,
        warnings=tuple(warnings),
        stats=stats or {},
    )


def plan_for_topology(
    topo: Topology,
    config: PlannerConfig | None = None,
    current: Mapping[int, tuple[int, int]] | None = None,
    time_limit_s: float | None = None,
    seed: int | None = None,
    clock: Callable[[], float] = time.monotonic,
    check: Check | None = None,
) -> Solution:
    """Solve a placement for ``topo`` (see module docstring). ``current`` seeds the search.

    ``check`` (placement -> validated score, e.g. ``p2pserve.sim.plan_check.simulation_check``):
    the publish guard. The solved placement and every heuristic baseline are scored by it and
    the best is returned (``stats["guard"]``; also the best tiered candidates, and optionally a
    climb on the check, ``stats["refine"]``), so a misleading estimate can never publish a
    placement the check ranks below a baseline.
    """
    config = config or PlannerConfig()
    if time_limit_s is not None or seed is not None:
        config = replace(
            config,
            time_limit_s=time_limit_s if time_limit_s is not None else config.time_limit_s,
            seed=seed if seed is not None else config.seed,
        )
    t0 = clock()
    check_memory(topo)
    starts = _starts(topo, current)
    stats: dict = {"starts": {k: max_flow(topo, v, config.partial).value for k, v in starts.items()}}
    solve = _solve_max_flow if config.objective == "max-flow" else _solve_throughput
    solution = solve(topo, config, starts, stats, t0, clock)
    if check is None:
        return solution
    return _checked(topo, config, solution, starts, _memo(check), stats, t0, clock)


def _checked(topo: Topology, config: PlannerConfig, solution: Solution, starts: dict, check: Check, stats: dict,
             t0: float, clock: Callable[[], float]) -> Solution:
    """The publish guard: the best by ``check`` of the solution, every heuristic baseline and
    ``config.challengers`` tiered candidates; then (``config.refine_checks``) a climb on the check
    from it, which can only raise its score."""
    baselines = {k: v for k, v in starts.items() if k != "current"}
    # Challengers: the estimate's best structured candidates. The estimate's own optimum is not
    # always the simulator's (cluster24: a tiered candidate at 304 estimated / 304 simulated
    # against the search's 315 / 296), so the check ranks a few of them too.
    est = throughput_score(topo, config)
    for j, p in enumerate(sorted(tiered_candidates(topo), key=est, reverse=True)[:config.challengers]):
        baselines[f"tiered{j}"] = p
    res = guard(solution.assignments, baselines, check)
    stats["guard"] = res.to_stats()
    best, method = res.placement, solution.method
    if res.overruled:
        method = f"{method}+guard({res.chosen})"
    if config.refine_checks > 0:
        refined, rs = refine(topo, best, check, config.refine_checks, seed=config.seed)
        stats["refine"] = rs.to_stats()
        if rs.improvements:
            best, method = refined, f"{method}+refine"
    if best == solution.assignments:
        return solution
    return make_solution(topo, best, config, clock() - t0, method, solution.solver_bound, stats)


def _memo(check: Check) -> Check:
    """``check`` evaluated once per distinct placement (it is deterministic, and costs seconds)."""
    cache: dict[tuple, float] = {}

    def memo(p) -> float:
        key = tuple(sorted((i, tuple(r)) for i, r in p.items()))
        if key not in cache:
            cache[key] = float(check(p))
        return cache[key]

    return memo


def _starts(topo: Topology, current: Mapping[int, tuple[int, int]] | None) -> dict[str, dict[int, tuple[int, int]]]:
    """The valid candidate placements the search starts from, by name."""
    starts: dict[str, dict[int, tuple[int, int]]] = {}
    if current:
        starts["current"] = {i: (r[0], r[1]) for i, r in current.items() if 0 <= i < topo.num_nodes}
    starts.update(all_heuristics(topo))
    starts["balanced_chain"] = balanced_chain(topo)
    starts = {k: v for k, v in starts.items() if v and not validate_placement(topo, v)}
    if not starts:
        raise PlanningError("no heuristic found a placement covering every layer")
    return starts


def _solve_max_flow(topo: Topology, config: PlannerConfig, starts: dict, stats: dict, t0: float,
                    clock: Callable[[], float]) -> Solution:
    """Objective ``max-flow``: annealing, then the MILP on what time is left (or MILP first on
    small clusters, then annealing if it did not prove optimality)."""
    budget = config.time_limit_s
    score = max_flow_score(topo, config.partial)

    def flow(p) -> float:
        return max_flow(topo, p, config.partial).value

    target = (1.0 - config.early_stop_gap) * topo.covering_upper_bound()
    # Small clusters: the MILP is exact and fast, so it goes first and may prove optimality;
    # large ones: the search finds good flows fast and the MILP gets what is left.
    small = topo.num_nodes <= SMALL_CLUSTER
    share = 0.75 if small else config.milp_share
    use_milp = config.use_milp and (small or config.work is None)
    search_time = budget * (1.0 - share) if use_milp else budget
    method, solver_bound = "search", None
    best = max(starts.values(), key=flow)
    if not (use_milp and small):
        best, st = improve(topo, list(starts.values()), score, search_time, seed=config.seed, target=target,
                           max_evals=config.work, clock=clock)
        stats["search"] = asdict(st)
    # Keep a margin for building the model and finishing the solution (flows, estimates).
    margin = 0.5 + 0.06 * topo.num_nodes
    left = budget * (share if small else 1.0) - (clock() - t0) - margin
    if use_milp and left > 0.2 and flow(best) < target:
        res = _run_milp(topo, config, best, left, stats)
        if res.bound and res.bound < float("inf"):
            solver_bound = res.bound
        if res.placement and res.objective > flow(best) + 1e-6:
            best, method = res.placement, "search+milp" if not small else "milp"
        if small and res.status != "Optimal":
            more, st = improve(topo, [best] + list(starts.values()), score, max(0.0, budget - (clock() - t0)),
                               seed=config.seed, target=target, max_evals=config.work, clock=clock)
            stats["search"] = asdict(st)
            if flow(more) > flow(best) + 1e-6:
                best, method = more, "milp+search"
    best = fill_idle(topo, best, score)
    return make_solution(topo, best, config, clock() - t0, method, solver_bound, stats)


def _run_milp(topo: Topology, config: PlannerConfig, best: Mapping[int, tuple[int, int]], time_limit_s: float,
              stats: dict) -> MilpResult:
    """The MILP warm-started with ``best`` (completed); its figures go to ``stats["milp"]``."""
    res = solve_milp(
        topo, time_limit_s,
        MilpOptions(partial=config.partial, early_stop_gap=config.early_stop_gap, seed=config.seed),
        warm_starts=[_complete(topo, best)], backend=config.backend,
        upper_bound=topo.covering_upper_bound(),
    )
    stats["milp"] = {
        "backend": res.backend, "objective": res.objective, "bound": res.bound,
        "status": res.status, "vars": res.num_vars, "rows": res.num_rows,
        "time_s": res.solve_time_s,
    }
    return res


def _solve_throughput(topo: Topology, config: PlannerConfig, starts: dict, stats: dict, t0: float,
                      clock: Callable[[], float]) -> Solution:
    """Objective ``throughput``: a short max-flow phase, then annealing on the decode estimate
    from the starts, the max-flow phase's best and the best tiered candidates."""
    budget = config.time_limit_s
    score = throughput_score(topo, config)
    # First a short max-flow phase so that high-flow structures are among the starts.
    work = config.work
    mf_best, _ = improve(
        topo, list(starts.values()), max_flow_score(topo, config.partial),
        budget * 0.1, seed=config.seed, max_evals=None if work is None else max(1, work // 10), clock=clock,
    )
    tiers = sorted(tiered_candidates(topo), key=score, reverse=True)[:4]
    stats["tiered_starts"] = len(tiers)
    pool = list(starts.values()) + [mf_best] + tiers
    best, st = improve(
        topo, pool, score, max(0.0, budget * 0.95 - (clock() - t0) - 0.05 * topo.num_nodes),
        seed=config.seed + 1, max_evals=None if work is None else max(1, work - work // 10), clock=clock,
    )
    stats["search"] = asdict(st)
    best = fill_idle(topo, best, score)
    return make_solution(topo, best, config, clock() - t0, "search(throughput)", None, stats)


def _complete(topo: Topology, placement: Mapping[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """Every node gets a range (the MILP's warm start needs one per node): idle nodes take a
    one-layer replica of layer 0, which can only add flow."""
    out = dict(placement)
    for i in range(topo.num_nodes):
        if i not in out:
            out[i] = (0, 1)
    return out
