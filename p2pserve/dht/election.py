"""Coordinator election and plan choice: pure rules, no I/O.

Every candidate reads the same live candidate set from the DHT and applies the same total
order, so all of them agree on the leader without talking to each other (up to DHT
propagation delay; a short overlap with two leaders is harmless because readers follow the
highest epoch and the old leader steps down as soon as it sees the new order).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import total_ordering
from typing import Iterable, Optional, Sequence

from p2pserve.dht.records import MAX_EPOCH, CoordinatorCandidate, Plan


def candidate_order_key(c: CoordinatorCandidate) -> tuple:
    """Sort key: highest priority first, then the oldest start, then the lowest id."""
    return (-c.priority, c.start_time, c.coordinator_id)


def elect_leader(candidates: Iterable[CoordinatorCandidate]) -> Optional[CoordinatorCandidate]:
    """The leader among the live candidates, or ``None`` if there are none."""
    return min(candidates, key=candidate_order_key, default=None)


def next_epoch(seen_epochs: Iterable[int]) -> int:
    """Epoch for a new plan: one more than the highest epoch seen from any trusted coordinator.

    Saturates at ``MAX_EPOCH``, the highest a valid plan may carry: a record already there (any
    member of an open swarm can publish one) must not make every honest plan invalid.
    """
    return min(max(seen_epochs, default=0) + 1, MAX_EPOCH)


@dataclass(frozen=True)
class SignedPlan:
    """A plan together with the public key that signed it (from the DHT subkey)."""

    plan: Plan
    signer: str


def plan_order_key(p: SignedPlan) -> tuple:
    """Highest epoch wins; ties (two leaders for a moment) go to the lowest leader id, then signer."""
    return (p.plan.epoch, _neg(p.plan.leader_id), _neg(p.signer))


def choose_plan(plans: Sequence[SignedPlan]) -> Optional[SignedPlan]:
    """The plan to follow among already-validated, trusted plans."""
    return max(plans, key=plan_order_key, default=None)


@total_ordering
class _neg:
    """Reverses string order inside a max() key (so the lowest string wins a tie)."""

    __slots__ = ("s",)

    def __init__(self, s: str):
        self.s = s

    def __lt__(self, other: "_neg") -> bool:
        return self.s > other.s

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _neg) and self.s == other.s
