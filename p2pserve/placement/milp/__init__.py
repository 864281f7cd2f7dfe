"""The placement MILP (Helix §4.4) with our tightenings, and the solvers that run it.

* :mod:`.linear` -- a solver-neutral MILP (:class:`LinearModel`);
* :mod:`.model` -- the placement formulation built into one (:func:`build_model`);
* :mod:`.backends` -- HiGHS, Gurobi and CP-SAT solving a :class:`LinearModel`;
* :mod:`.solve` -- :func:`solve_milp`: build, warm-start, solve, read the placement back.

Each module imports only those listed before it.
"""

from p2pserve.placement.milp.linear import LinearModel
from p2pserve.placement.milp.model import MilpOptions, build_model, identical_groups
from p2pserve.placement.milp.solve import MilpResult, solve_milp

__all__ = ["LinearModel", "MilpOptions", "MilpResult", "build_model", "identical_groups", "solve_milp"]
