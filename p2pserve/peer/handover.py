"""Make-before-break: when a peer that has loaded its new range may drop the old one.

Peers follow a new plan one by one, each as soon as its own load finishes. A peer that flips
the moment it is loaded drops layers that the peer taking them over may still be loading, and
for that while no route covers them. So a loaded peer waits until the layers it would drop are
served by someone else, within limits:

* a dropped layer that another peer *serves* is safe: flip;
* layers another live peer is *loading*, or is assigned by the current plan, are coming: wait
  for them (up to ``max_wait_s``);
* two peers swapping ranges would each wait for the other. A peer that has finished loading
  says so (``PeerInfo.loaded``). Once the dropped layers are all being taken by loaded peers
  that still serve their old ranges, and our own "loaded" has been announced for ``settle_s``
  (so the partners saw it too), the swap goes ahead without a gap where it can: a peer whose
  old and new ranges overlap or touch first *bridges*, serving both at once from the layers it
  holds in memory (:func:`hull`), and drops the old part once the partner serves it. The
  partner, seeing the bridge, is covered and flips. Only where neither side can bridge do the
  two flip together, leaving the swapped layers unserved until the second flip is announced.
  A loaded peer that serves nothing yet waits for nobody: it flips by itself, so we wait to see
  it serve;
* layers nobody serves, loads or is assigned: wait ``grace_s``, then flip (waiting longer would
  only delay the new range).

A loaded peer that the plan moves elsewhere before it flips discards its load, unless a partner
already flipped counting on it (a swap cut in two by a new plan): layers of the loaded range
that nobody serves any more (:func:`orphaned`) keep the handover going, so the swap completes
and the next plan moves the peer on from there (:func:`handover_step` decides both).

Pure decision logic; ``SwarmAgent`` polls it with the peers' DHT records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal, Optional

from p2pserve.types import LayerRange

Span = LayerRange


@dataclass(frozen=True)
class OtherPeer:
    """What the decision needs of another peer's announcement."""

    serving: Optional[Span]
    loading: Optional[Span] = None
    loaded: bool = False
    target: Optional[Span] = None  # its range in the current plan
    tp: int = 1  # a tensor-parallel group (tp > 1) cannot bridge


def _bridges(o: OtherPeer) -> bool:
    """Whether a loaded peer could serve its old and new ranges at once (or already does)."""
    return o.tp == 1 and hull(o.serving, o.loading) is not None


def _layers(span: Optional[Span]) -> set[int]:
    return set(range(span[0], span[1])) if span else set()


def _loading(peers: Iterable[OtherPeer]) -> set[int]:
    """The layers ``peers`` are loading."""
    return set().union(*(_layers(o.loading) for o in peers))


Step = Literal["flip", "wait", "bridge", "drop"]


def hull(a: Optional[Span], b: Optional[Span]) -> Optional[Span]:
    """The one range covering ``a`` and ``b`` when they overlap or touch; None otherwise."""
    if a is None or b is None or max(a[0], b[0]) > min(a[1], b[1]):
        return None
    return (min(a[0], b[0]), max(a[1], b[1]))


def flip_decision(
    serving: Optional[Span],
    target: Span,
    others: Iterable[OtherPeer],
    waited_s: float,
    grace_s: float,
    settle_s: float,
    max_wait_s: float,
    can_bridge: bool = True,
) -> tuple[Literal["flip", "wait", "bridge"], str]:
    """Whether to flip from ``serving`` to the loaded ``target`` now, wait, or first serve
    both (``bridge``: to :func:`hull`; only where ``can_bridge``); and why (for the log)."""
    dropped = _layers(serving) - _layers(target)
    if not dropped:
        return "flip", "drops no layer"
    others = list(others)
    served = set().union(*(_layers(o.serving) for o in others))
    missing = dropped - served
    if not missing:
        return "flip", "every dropped layer is served by another peer"
    if waited_s >= max_wait_s:
        return "flip", f"waited {waited_s:.0f} s for layers {_fmt(missing)}; flipping anyway"
    partners = [o for o in others if o.loaded and o.serving]
    if not (missing - _loading(partners)) and waited_s >= settle_s:
        both = hull(serving, target)
        if can_bridge and both is not None and both != serving:
            return "bridge", f"the peers taking layers {_fmt(missing)} are loaded too: serving both ranges first"
        # a partner that can bridge will: wait to see it serve them (never flip together with it)
        fixed = [o for o in partners if not _bridges(o)]
        if both != serving and not (missing - _loading(fixed)):
            return "flip", "the peers taking the dropped layers are loaded too and cannot bridge: flipping together"
    coming = set().union(*(_layers(o.loading) | _layers(o.target) for o in others))
    if not (missing - coming):
        return "wait", f"layers {_fmt(missing)} are being loaded by (or assigned to) another peer"
    if waited_s < grace_s:
        return "wait", f"nobody serves or loads layers {_fmt(missing)} yet"
    return "flip", f"nobody is taking layers {_fmt(missing)}; flipping"


def handover_step(
    serving: Optional[Span],
    target: Span,
    others: Iterable[OtherPeer],
    moved: bool,
    waited_s: float,
    grace_s: float,
    settle_s: float,
    max_wait_s: float,
    can_bridge: bool = True,
) -> tuple[Step, str]:
    """One poll of a loaded peer's handover to ``target``: flip now, wait, bridge (serve
    ``hull(serving, target)`` for now), or drop the load (``moved``: the current plan gives this
    peer another range); and why (for the log)."""
    others = list(others)
    lost = orphaned(serving, target, others) if moved else set()
    if moved and not lost:
        return "drop", "the plan moved this peer again before the handover"
    step, reason = flip_decision(serving, target, others, waited_s, grace_s, settle_s, max_wait_s, can_bridge)
    if lost:  # a partner flipped counting on this load: finish the swap; the next plan moves us on
        reason = f"moved by the plan, but nobody else serves {_fmt(lost)} of this range; {reason}"
    return step, reason


def orphaned(serving: Optional[Span], loaded: Span, others: Iterable[OtherPeer]) -> set[int]:
    """Layers of the ``loaded`` range that neither this peer (``serving``) nor any other serves."""
    served = set().union(_layers(serving), *(_layers(o.serving) for o in others))
    return _layers(loaded) - served


def _fmt(layers: set[int]) -> str:
    """Layers as compact half-open runs: {1, 2, 3, 7} -> '[1, 4) [7, 8)'."""
    out, run = [], None
    for layer in sorted(layers):
        if run and layer == run[1]:
            run[1] += 1
        else:
            if run:
                out.append(run)
            run = [layer, layer + 1]
    if run:
        out.append(run)
    return " ".join(f"[{a}, {b})" for a, b in out)
