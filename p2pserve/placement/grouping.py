"""Choose each machine's GPU grouping together with the layer placement (HexGen §4, our way).

A machine of ``n`` GPUs can serve as one TP-n node, as several smaller TP groups, or as ``n``
single GPUs; a *grouping* is the multiset of TP degrees (powers of two that divide the model's
heads, :func:`machine_groupings`). For a choice of grouping per machine, the existing planner
(:func:`~p2pserve.placement.planner.plan_for_topology`) places layers on the resulting nodes
and scores the placement by its decode-throughput estimate; :func:`plan_grouping` searches the
groupings by coordinate ascent (one machine at a time, every alternative, keep the best),
starting from the best *uniform* choice (one TP degree for every machine). The score of a
choice is pluggable (``score(topology, solution)``): by default the planner's own decode
estimate; a caller that may run the simulator (``p2pserve.sim.tp_groups.sim_score``) passes
that instead -- the estimate's constants were fitted to single-GPU Helix nodes and misjudge
large TP groups (docs/hexgen.md gives the figures). Every planner call
runs on a fixed evaluation budget (``PlannerConfig.work``), so the same inputs and seed give
the same grouping and placement on any machine. Machines with one GPU have one grouping and
are left to the planner as they are. Pure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from p2pserve.errors import ConfigError, PlanningError
from p2pserve.placement.machines import Group, MachineCluster, group_topology
from p2pserve.placement.planner import PlannerConfig, plan_for_topology
from p2pserve.placement.solution import Solution
from p2pserve.placement.topology import Topology
from p2pserve.placement.tp_cost import ModelShape

#: A machine's grouping: TP degrees, largest first, summing to its GPU count.
Grouping = tuple[int, ...]


def allowed_degrees(count: int, model: ModelShape, max_degree: int = 8) -> list[int]:
    """TP degrees a machine of ``count`` GPUs may use: powers of two, <= count and
    ``max_degree``, dividing the model's heads and KV heads."""
    out, d = [], 1
    while d <= min(count, max_degree):
        if model.tp_ok(d):
            out.append(d)
        d *= 2
    return out


def machine_groupings(count: int, model: ModelShape, max_degree: int = 8) -> list[Grouping]:
    """Every grouping of ``count`` GPUs into allowed TP degrees (largest degree first)."""
    degrees = sorted(allowed_degrees(count, model, max_degree), reverse=True)
    out: list[Grouping] = []

    def rec(left: int, top: int, acc: tuple[int, ...]) -> None:
        if left == 0:
            out.append(acc)
            return
        for d in degrees:
            if d <= top and d <= left:
                rec(left - d, d, acc + (d,))

    rec(count, count, ())
    return out


def fixed_grouping(count: int, d: int, model: ModelShape, max_degree: int = 8) -> Grouping:
    """``count`` GPUs at one TP degree ``d``: as many TP-``d`` groups as fit, the rest in the
    largest allowed degrees below (a 3-GPU box at TP-2 is ``(2, 1)``)."""
    degrees = sorted(allowed_degrees(count, model, max_degree), reverse=True)
    out: list[int] = []
    left = count
    for deg in degrees:
        if deg > d:
            continue
        while left >= deg:
            out.append(deg)
            left -= deg
    return tuple(out)


def groups_of(cluster: MachineCluster, choice: Sequence[Grouping]) -> list[Group]:
    """The groups of a per-machine choice: consecutive GPU indices, machine by machine."""
    if len(choice) != len(cluster.machines):
        raise ConfigError(f"{len(choice)} groupings for {len(cluster.machines)} machines")
    groups: list[Group] = []
    for m, (machine, grouping) in enumerate(zip(cluster.machines, choice)):
        if sum(grouping) != machine.count:
            raise ConfigError(f"grouping {grouping} does not use the {machine.count} GPUs of {machine.name}")
        g = 0
        for d in grouping:
            groups.append(Group(tuple((m, g + j) for j in range(d))))
            g += d
    return groups


@dataclass(frozen=True)
class GroupingConfig:
    """Search settings. ``eval_work``: planner evaluations per candidate grouping (the chosen
    grouping's placement is the one that was scored: the planner is deterministic on a work
    budget); ``max_candidates``: groupings tried in all (the search's work budget);
    ``max_degree``: largest TP degree considered."""

    planner: PlannerConfig = field(default_factory=lambda: PlannerConfig(time_limit_s=600.0))
    eval_work: int = 300
    max_candidates: int = 60
    max_degree: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if self.eval_work < 1 or self.max_candidates < 1:
            raise ConfigError("grouping search budgets must be at least 1")


@dataclass
class GroupingResult:
    """The chosen grouping per machine, its groups, topology and placement, its ``score``, and
    the search's record (``tried``: candidate -> score; ``solve_time_s``)."""

    choice: tuple[Grouping, ...]
    groups: list[Group]
    topology: Topology
    solution: Solution
    tried: dict = field(default_factory=dict)
    solve_time_s: float = 0.0
    score: float = 0.0


def plan_choice(cluster: MachineCluster, choice: Sequence[Grouping], config: GroupingConfig,
                work: int) -> tuple[list[Group], Topology, Solution]:
    """Place layers on the nodes of ``choice`` with the planner on ``work`` evaluations."""
    groups = groups_of(cluster, choice)
    topo = group_topology(cluster, groups)
    cfg = replace(config.planner, work=work, seed=config.seed)
    return groups, topo, plan_for_topology(topo, cfg)


#: Scores a grouping by the planner's placement on it: ``score(topology, solution)``, higher is better.
Score = Callable[[Topology, Solution], float]


def estimate_score(topo: Topology, solution: Solution) -> float:
    """The planner's decode-throughput estimate of its placement, capped at its max-flow's
    decode share (the default score).

    The estimate (Little's law over KV-bound concurrency, ``placement/estimate.py``) was fitted
    on single GPUs, where prompts cost little next to decode, and leaves prompt time out. A
    large TP group over PCIe spends most of its time on prompts (two all-reduces of every
    prompt token's hidden state per layer), which its ``T[k]`` counts (``GroupCost``'s steady
    mix) and the max-flow bounds. Uncapped, the estimate ranks the full-price cluster's uniform
    groupings TP-8 > TP-4 > TP-2 > TP-1 (2,420 / 1,693 / 1,046 / 629 tokens/s); capped, TP-4 >
    TP-8 > TP-2 > TP-1 (1,693 / 1,359 / 1,046 / 629), and the steady-state simulation's best
    is TP-4 (1,422; docs/hexgen.md)."""
    e = solution.estimate
    return min(e.decode_tokens_per_s, e.compute_bound_decode_tokens_per_s)


def _score(cluster: MachineCluster, choice: tuple[Grouping, ...], config: GroupingConfig, score: Score) -> float:
    """``score`` of the planner's placement on ``choice`` (-1 if no placement exists)."""
    try:
        _, topo, sol = plan_choice(cluster, choice, config, config.eval_work)
    except PlanningError:  # InsufficientMemoryError included: the grouping cannot hold a copy
        return -1.0
    return score(topo, sol)


def uniform_choices(cluster: MachineCluster, config: GroupingConfig) -> dict[int, tuple[Grouping, ...]]:
    """One TP degree for every machine (the symmetric baselines), by degree."""
    m = cluster.model
    top = max(max(allowed_degrees(x.count, m, config.max_degree)) for x in cluster.machines)
    out, d = {}, 1
    while d <= top:
        if m.tp_ok(d):
            out[d] = tuple(fixed_grouping(x.count, d, m, config.max_degree) for x in cluster.machines)
        d *= 2
    return out


def plan_grouping(cluster: MachineCluster, config: GroupingConfig | None = None, score: Score | None = None,
                  clock: Callable[[], float] = time.perf_counter) -> GroupingResult:
    """Choose every machine's grouping and the placement together (module docstring)."""
    config = config or GroupingConfig()
    score_fn = score or estimate_score
    t0 = clock()
    tried: dict[tuple[Grouping, ...], float] = {}

    def value(choice: tuple[Grouping, ...]) -> float:
        if choice not in tried:
            tried[choice] = _score(cluster, choice, config, score_fn)
        return tried[choice]

    best = max(uniform_choices(cluster, config).values(), key=value)
    options = [machine_groupings(x.count, cluster.model, config.max_degree) for x in cluster.machines]
    improved = True
    while improved and len(tried) < config.max_candidates:
        improved = False
        for m, opts in enumerate(options):
            for opt in opts:
                if len(tried) >= config.max_candidates:
                    break
                cand = best[:m] + (opt,) + best[m + 1:]
                if value(cand) > value(best) + 1e-9:
                    best, improved = cand, True
    if value(best) < 0:
        raise PlanningError("no grouping of the machines holds a copy of the model")
    groups, topo, sol = plan_choice(cluster, best, config, config.eval_work)  # the scored placement
    return GroupingResult(best, groups, topo, sol, {"|".join(map(str, k)): v for k, v in tried.items()},
                          clock() - t0, value(best))
