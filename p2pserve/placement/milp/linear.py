"""A solver-neutral mixed-integer linear program: what every backend in :mod:`backends` reads."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LinearModel:
    """Columns with bounds and integrality, sparse rows ``lo <= a.x <= hi``, a max objective."""

    names: list[str] = field(default_factory=list)
    lb: list[float] = field(default_factory=list)
    ub: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    obj: list[float] = field(default_factory=list)
    rows: list[tuple[dict[int, float], float, float]] = field(default_factory=list)

    def var(self, name: str, lb: float, ub: float, integer: bool, obj: float = 0.0) -> int:
        """Add a column; returns its index."""
        self.names.append(name)
        self.lb.append(lb)
        self.ub.append(ub)
        self.integer.append(integer)
        self.obj.append(obj)
        return len(self.names) - 1

    def row(self, coefs: dict[int, float], lo: float = -float("inf"), hi: float = float("inf")) -> None:
        """Add ``lo <= sum coefs[j] * x_j <= hi``."""
        self.rows.append((coefs, lo, hi))

    @property
    def num_vars(self) -> int:
        """Number of columns."""
        return len(self.names)

    @property
    def num_rows(self) -> int:
        """Number of constraints."""
        return len(self.rows)
