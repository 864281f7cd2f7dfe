"""Regrouping a machine's GPUs without a layer going unserved: the transition plan.

Changing a machine's grouping (one TP-4 node into 2 x TP-2, say) cannot load the new groups
next to the old ones -- they share the GPUs. The transition follows the make-before-break rule
of layer moves (``placement/moves.py``, ``peer/handover.py``): nothing stops serving before what
replaces it serves. :func:`regroup_plan` orders the steps:

1. ``load`` a new group as soon as all of its GPUs are free; it serves before anything drops;
2. ``drop`` an old group once the nodes serving without it still cover every layer;
3. when every remaining old group holds GPUs a new group needs and would leave layers
   uncovered, ``bridge``: a serving node outside the regrouped GPUs widens its range to cover
   those layers first (it loads them, then serves the wider range); after the new groups serve,
   ``unbridge`` narrows it back.

If no node can bridge, the plan raises :class:`~p2pserve.errors.PlanningError` rather than drop
coverage. Each step carries the serving map after it, so callers (and tests) can check the
invariant. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from p2pserve.errors import PlanningError

Range = tuple[int, int]


@dataclass(frozen=True)
class Node:
    """A serving node (a TP group): its GPUs, its layer range and the most layers it holds."""

    gpus: frozenset
    span: Range
    max_layers: int


@dataclass(frozen=True)
class Step:
    """One transition step and the serving ranges once it is done."""

    action: str  # load | drop | bridge | unbridge
    node: str
    span: Range | None
    serving: dict


def uncovered(serving: Mapping[str, Range], num_layers: int) -> list[int]:
    """Layers no serving range covers."""
    cover = [False] * num_layers
    for s, e in serving.values():
        for layer in range(max(0, s), min(e, num_layers)):
            cover[layer] = True
    return [layer for layer, c in enumerate(cover) if not c]


def _widened(span: Range, gap: list[int], max_layers: int) -> Range | None:
    """``span`` widened to contain ``gap`` if the result is contiguous and fits, else None."""
    lo, hi = min(gap), max(gap) + 1
    if hi < span[0] or lo > span[1]:  # neither overlapping nor touching: not one range
        return None
    new = (min(lo, span[0]), max(hi, span[1]))
    return new if new[1] - new[0] <= max_layers else None


def regroup_plan(old: Mapping[str, Node], new: Mapping[str, Node], num_layers: int) -> list[Step]:  # long: the loop is the algorithm
    """Steps from serving ``old`` to serving ``new`` without uncovering a layer (module docstring).

    Nodes present in both (same name, GPUs and range) stay untouched.
    """
    serving = {n: x.span for n, x in old.items()}
    nodes = dict(old)
    if uncovered(serving, num_layers):
        raise PlanningError("the current serving ranges already leave layers uncovered")
    pending = sorted(n for n in new if old.get(n) != new[n])
    to_drop = sorted(n for n in old if old[n] != new.get(n))
    bridged: dict[str, Range] = {}
    steps: list[Step] = []

    def busy() -> set:
        return set().union(*(nodes[n].gpus for n in serving)) if serving else set()

    def record(action: str, name: str, span: Range | None) -> None:
        steps.append(Step(action, name, span, dict(serving)))

    while pending or to_drop:
        progress = False
        for name in list(pending):
            if not (new[name].gpus & busy()):
                nodes[name] = new[name]
                serving[name] = new[name].span
                pending.remove(name)
                record("load", name, new[name].span)
                progress = True
        for name in list(to_drop):
            rest = {n: r for n, r in serving.items() if n != name}
            if not uncovered(rest, num_layers):
                del serving[name]
                to_drop.remove(name)
                record("drop", name, None)
                progress = True
        if progress:
            continue
        # Stuck: every old group left would uncover layers. Bridge the first one's gap with a
        # node that stays (not regrouped), then drop it on the next pass.
        name = to_drop[0]
        gap = uncovered({n: r for n, r in serving.items() if n != name}, num_layers)
        helper = _bridge(nodes, serving, set(to_drop), gap)
        if helper is None:
            raise PlanningError(f"dropping {name} would leave layers {gap[0]}..{gap[-1]} unserved "
                                "and no serving node can bridge them")
        bridged.setdefault(helper[0], serving[helper[0]])
        serving[helper[0]] = helper[1]
        record("bridge", helper[0], helper[1])
    for name, span in sorted(bridged.items()):
        target = new[name].span if name in new else span
        serving[name] = target
        if uncovered(serving, num_layers):
            raise PlanningError(f"narrowing {name} back would leave layers unserved")
        record("unbridge", name, target)
    return steps


def _bridge(nodes: Mapping[str, Node], serving: Mapping[str, Range], leaving: set,
            gap: list[int]) -> tuple[str, Range] | None:
    """A serving node that stays and can widen its range over ``gap``: the one that loads the
    fewest extra layers (then by name)."""
    best = None
    for n in sorted(serving):
        if n in leaving:
            continue
        span = serving[n]
        wide = _widened(span, gap, nodes[n].max_layers)
        if wide is None:
            continue
        extra = (wide[1] - wide[0]) - (span[1] - span[0])
        if best is None or extra < best[0]:
            best = (extra, n, wide)
    return None if best is None else (best[1], best[2])
