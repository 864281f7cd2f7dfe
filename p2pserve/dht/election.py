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


#: Epochs a plan may carry beyond what time allows: ``EPOCH_HEADROOM`` plus 1000 per second of
#: DHT time since 1970 (:func:`epoch_ceiling`). Honest coordinators count up by one per plan, far
#: below it; a plan whose epoch jumps past it (to win every tie for good) is not followed.
EPOCH_HEADROOM = 1 << 32
EPOCHS_PER_S = 1000


def epoch_ceiling(now: float) -> int:
    """The highest epoch a plan may carry at DHT time ``now`` (readers add their clock skew)."""
    return min(EPOCH_HEADROOM + int(max(now, 0.0) * EPOCHS_PER_S), MAX_EPOCH)


def next_epoch(seen_epochs: Iterable[int], now: Optional[float] = None) -> int:
    """Epoch for a new plan: one more than the highest epoch seen from any trusted coordinator.

    Saturates at what time allows at ``now`` (:func:`epoch_ceiling`; without ``now``, at
    ``MAX_EPOCH``): a record already there must not make every honest plan invalid.
    """
    ceiling = epoch_ceiling(now) if now is not None else MAX_EPOCH
    return min(max(seen_epochs, default=0) + 1, ceiling)


def elected_plans(plans: Sequence["SignedPlan"], candidates: Iterable[CoordinatorCandidate],
                  normalize) -> list["SignedPlan"]:
    """In an open swarm, the plans of the elected leader only: signed by the key the leader's live
    candidacy declares, under its coordinator id (``normalize`` makes keys comparable). A key that
    never stood for election, or a candidate that is not the leader, is not followed."""
    leader = elect_leader(candidates)
    return [p for p in plans if _led_by(leader, p.plan.leader_id, p.signer, normalize)]


def is_elected(leader_id: str, signer: str, candidates: Iterable[CoordinatorCandidate], normalize) -> bool:
    """Whether a plan naming ``leader_id`` and signed by ``signer`` comes from the elected leader
    (the rule of :func:`elected_plans`, for a plan not yet assembled)."""
    return _led_by(elect_leader(candidates), leader_id, signer, normalize)


def _led_by(leader: Optional[CoordinatorCandidate], leader_id: str, signer: str, normalize) -> bool:
    return leader is not None and leader_id == leader.coordinator_id and normalize(signer) == normalize(leader.public_key)


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
