"""A placement's simulated decode throughput, as a callable the planner's publish guard can use.

``placement/`` is pure and the simulator imports it, so the planner cannot import the
simulator; callers build the check here and hand it to ``plan_for_topology(..., check=...)``:
from a Helix cluster file (the benchmarks, ``p2pserve plan``/``sim``: :func:`simulation_check`),
or from the planner's ``Topology`` alone (a live swarm: :func:`topology_check`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable, Mapping

from p2pserve.helix import format as hf
from p2pserve.sim.run import SimConfig, simulate
from p2pserve.placement.topology import Topology
from p2pserve.sim.scenario import Part, build_scenario, topology_scenario

Placement = Mapping[int, tuple[int, int]]


def simulated_decode(
    cluster: hf.HelixCluster,
    model: str,
    placement: Placement,
    duration: float = 600.0,
    warmup: float = 60.0,
    seed: int = 0,
    flows: Mapping[tuple[int, int], float] | None = None,
    root: Path | None = None,
    throttle: bool | str = False,
) -> float:
    """Decode tokens/s of ``placement`` (offline, IWRR) over ``warmup`` + ``duration`` seconds.

    ``flows`` replaces the max-flow edge flows as IWRR's weights (routing experiments);
    ``throttle`` is the nodes' batching (``SimConfig.throttle``).
    """
    sc = build_scenario(model, [Part(cluster, dict(placement))], root=root)
    if flows is not None:
        sc = replace(sc, flows=dict(flows))
    res = simulate(sc, SimConfig(duration=duration, warmup=warmup, seed=seed, throttle=throttle))
    return res.decode_throughput_tokens_per_s


def simulation_check(
    cluster: hf.HelixCluster,
    model: str,
    duration: float = 600.0,
    warmup: float = 60.0,
    seed: int = 1,
    root: Path | None = None,
    throttle: bool | str = False,
) -> Callable[[Placement], float]:
    """A check for the planner's guard: placement -> simulated decode tokens/s.

    Seed 1 by default, so that benchmarks reporting seed-0 simulations do not score the guard
    on the very run it chose by. ``throttle``: the nodes' batching (``SimConfig.throttle``):
    Helix's caps by default, ``"chunked"`` for p2pserve's engine.
    """

    def check(placement: Placement) -> float:
        return simulated_decode(cluster, model, placement, duration, warmup, seed, root=root, throttle=throttle)

    return check


def simulable(topo: Topology) -> bool:
    """Whether every node of ``topo`` carries what :func:`topology_check` needs (a latency
    profile and KV capacities); a live swarm whose peers announce less cannot be simulated."""
    return bool(topo.nodes) and all(n.profile is not None and any(n.kv_capacity) for n in topo.nodes)


def topology_check(
    topo: Topology,
    duration: float = 240.0,
    warmup: float = 60.0,
    seed: int = 1,
    root: Path | None = None,
    throttle: bool | str = "chunked",
) -> Callable[[Placement], float]:
    """A check for the guard built from the planner's ``Topology`` (no cluster file): offline,
    IWRR, Azure lengths, ``warmup`` + ``duration`` seconds at simulator ``seed``, nodes batching
    as p2pserve peers do by default (gLLM throttling with chunked prefill; ``throttle``). See
    :func:`p2pserve.sim.scenario.topology_scenario` for what each node must carry."""

    def check(placement: Placement) -> float:
        sc = topology_scenario(topo, placement, root=root)
        res = simulate(sc, SimConfig(duration=duration, warmup=warmup, seed=seed, throttle=throttle))
        return res.decode_throughput_tokens_per_s

    return check


def live_check(duration: float = 240.0, warmup: float = 60.0, seed: int = 1) -> Callable[[Topology], Callable[[Placement], float] | None]:
    """A check factory for a coordinator (``CoordinatorService(plan_check=...)``): each round's
    topology gets a :func:`topology_check` when it is :func:`simulable`, else None (no guard).

    The window stays at Helix's scale whatever the model: a shorter one measures the start-up
    transient of a 70B swarm (its first prompts take tens of seconds). Measured: a guarded full
    solve takes 38 s on cluster24, 95 s on cluster42, 12 s for four tiny-model peers."""

    def factory(topo: Topology) -> Callable[[Placement], float] | None:
        if not simulable(topo):
            return None
        return topology_check(topo, duration=duration, warmup=warmup, seed=seed)

    return factory
