"""Why a coordinator re-plans: a :class:`Trigger` that control flow branches on, and a
:class:`Reason` that adds the text logged and stored in ``Plan.reason``."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Trigger(Enum):
    """What made the coordinator re-plan (the value is the text a bare reason logs)."""

    INITIAL = "initial"  # no plan yet
    ELECTED = "elected"  # this node just took the lead
    SAW_EPOCH = "saw epoch"  # another leader published a higher epoch than ours
    MEMBERSHIP = "membership"  # a peer joined or left
    SERVED_RANGES = "served ranges changed"  # a peer flipped to another range
    LINK = "link changed"  # a link appeared or its bandwidth changed beyond the threshold
    PERIODIC = "periodic"  # replan_period elapsed

    @property
    def bumps_epoch(self) -> bool:
        """A new leader (or one overtaken) publishes a new epoch even if the content is unchanged."""
        return self in (Trigger.ELECTED, Trigger.SAW_EPOCH)

    @property
    def remeasures(self) -> bool:
        """Measurements changed what links carry: a fresh solve, adopted only if it pays its reloads."""
        return self in (Trigger.PERIODIC, Trigger.LINK)


@dataclass(frozen=True)
class Reason:
    """A trigger and the text that explains it (e.g. ``join …3xY9a``, ``saw epoch 7 from c2``)."""

    trigger: Trigger
    text: str = ""

    def __str__(self) -> str:
        return self.text or self.trigger.value
