"""A clock tests move by hand."""

from __future__ import annotations


class FakeClock:
    """A clock tests move by hand: ``clock()`` returns ``clock.t``; ``advance(dt)`` moves it."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> float:
        """Move the clock forward by ``dt`` seconds and return the new time."""
        self.t += dt
        return self.t


# ============================================================================== control plane
