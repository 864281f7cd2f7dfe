"""MILP backends for a :class:`~p2pserve.placement.milp.linear.LinearModel`: HiGHS (default),
Gurobi (full licence), CP-SAT.

``solve(model, ...)`` returns a :class:`BackendResult`. ``backend="auto"`` picks, in order:

* Gurobi, only when ``gurobipy`` imports *and* accepts a model of this size: the pip wheel's
  restricted licence refuses models over 2,000 variables or constraints, which we detect (a
  ``GurobiError`` on optimize, or the size check);
* CP-SAT, when ``ortools`` imports (the ``ortools`` extra). Measured here with 30 s per solve and
  the same warm starts: it proves cluster10's optimum (286.59 tokens/s) in 14-19 s where
  HiGHS's bound stays at 352.61, and on cluster24 it ties HiGHS (incumbent and bound 2,336.98);
* HiGHS otherwise. The default install has neither of the others, so the default path needs
  no licence and no extra.

``ortools`` 9.15 pins protobuf < 6.34, while the grpcio-tools that hivemind pulls in needs
protobuf >= 7.35.1: installing the extra into p2pserve's environment needs an older grpcio-tools.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from p2pserve.placement.milp.linear import LinearModel

#: Size above which the pip (restricted) Gurobi licence refuses to optimise.
GUROBI_RESTRICTED_LIMIT = 2000


@dataclass
class BackendResult:
    """Column vector (or None), the best bound, a status string, and an incumbent trace."""

    x: list[float] | None
    objective: float
    bound: float
    status: str
    backend: str
    trace: list[tuple[float, float]] = field(default_factory=list)


@dataclass(frozen=True)
class SolveSettings:
    """What every backend is told besides the model: threads, seed, and an early-stop target.

    HiGHS keeps one thread scheduler per process and refuses, at once and silently ("Not
    Set"), a model that asks for another thread count: every solve in a process must use the
    same ``threads``.
    """

    threads: int = 2
    seed: int = 0
    target: float | None = None  # stop once the incumbent reaches it


def solve(
    model: LinearModel,
    time_limit_s: float,
    starts: list[list[float]],
    backend: str,
    settings: SolveSettings = SolveSettings(),
) -> BackendResult:
    """Dispatch to a backend (see module docstring)."""
    if backend in ("auto", "gurobi"):
        res = _try_gurobi(model, time_limit_s, starts, settings)
        if res is not None:
            return res
        if backend == "gurobi":
            backend = "highs"  # fall back cleanly, the caller sees res.backend == "highs"
    if backend == "cpsat" or (backend == "auto" and cpsat_available()):
        return _solve_cpsat(model, time_limit_s, starts, settings)
    return _solve_highs(model, time_limit_s, starts, settings)


def cpsat_available() -> bool:
    """True when OR-Tools' CP-SAT imports."""
    try:
        from ortools.sat.python import cp_model  # noqa: F401
    except Exception:
        return False
    return True


def gurobi_available(num_vars: int = 0, num_rows: int = 0) -> bool:
    """True when gurobipy imports and a model of this size is within its licence."""
    try:
        import gurobipy  # noqa: F401
    except Exception:
        return False
    if max(num_vars, num_rows) <= GUROBI_RESTRICTED_LIMIT:
        return True
    try:  # a full licence optimises a model above the restricted limit
        import gurobipy as gp

        with gp.Env(params={"OutputFlag": 0}) as env, gp.Model(env=env) as m:
            m.addVars(GUROBI_RESTRICTED_LIMIT + 1)
            m.optimize()
        return True
    except Exception:
        return False


def _try_gurobi(model, time_limit_s, starts, settings) -> BackendResult | None:
    if not gurobi_available(model.num_vars, model.num_rows):
        return None
    try:
        return _solve_gurobi(model, time_limit_s, starts, settings)
    except Exception:  # licence or environment problem discovered late: fall back
        return None


def _solve_gurobi(model, time_limit_s, starts, settings) -> BackendResult:
    import gurobipy as gp
    from gurobipy import GRB

    t0 = time.monotonic()
    trace: list[tuple[float, float]] = []
    with gp.Env(params={"OutputFlag": 0}) as env, gp.Model(env=env) as m:
        xs = [
            m.addVar(lb=model.lb[j], ub=model.ub[j], vtype=GRB.INTEGER if model.integer[j] else GRB.CONTINUOUS, obj=model.obj[j])
            for j in range(model.num_vars)
        ]
        m.ModelSense = GRB.MAXIMIZE
        for coefs, lo, hi in model.rows:
            expr = gp.quicksum(v * xs[j] for j, v in coefs.items())
            if lo == hi:
                m.addConstr(expr == lo)
            else:
                if lo > -float("inf"):
                    m.addConstr(expr >= lo)
                if hi < float("inf"):
                    m.addConstr(expr <= hi)
        m.Params.TimeLimit = max(0.1, time_limit_s)
        m.Params.Threads = settings.threads
        m.Params.Seed = settings.seed
        if settings.target is not None:
            m.Params.BestObjStop = settings.target
        if starts:
            m.NumStart = len(starts)
            for si, st in enumerate(starts):
                m.Params.StartNumber = si
                for j, v in enumerate(st):
                    xs[j].Start = v

        def cb(mm, where):
            if where == GRB.Callback.MIPSOL:
                trace.append((time.monotonic() - t0, mm.cbGet(GRB.Callback.MIPSOL_OBJ)))

        m.optimize(cb)
        x = [v.X for v in xs] if m.SolCount > 0 else None
        obj = m.ObjVal if m.SolCount > 0 else 0.0
        return BackendResult(x, obj, m.ObjBound, str(m.Status), "gurobi", trace)


def _highs_lp(model: LinearModel):
    """The model as a ``highspy.HighsLp`` (row-wise sparse matrix), maximising."""
    import highspy
    import numpy as np

    inf = highspy.kHighsInf
    lp = highspy.HighsLp()
    lp.num_col_ = model.num_vars
    lp.num_row_ = model.num_rows
    lp.col_cost_ = np.array(model.obj, dtype=float)
    lp.col_lower_ = np.array(model.lb, dtype=float)
    lp.col_upper_ = np.array(model.ub, dtype=float)
    lp.row_lower_ = np.array([lo if lo > -float("inf") else -inf for _, lo, _ in model.rows], dtype=float)
    lp.row_upper_ = np.array([hi if hi < float("inf") else inf for _, _, hi in model.rows], dtype=float)
    starts_idx, index, value = [0], [], []
    for coefs, _, _ in model.rows:
        for j, v in coefs.items():
            if v != 0.0:
                index.append(j)
                value.append(v)
        starts_idx.append(len(index))
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.array(starts_idx, dtype=np.int32)
    lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(value, dtype=float)
    lp.a_matrix_.num_col_ = model.num_vars
    lp.a_matrix_.num_row_ = model.num_rows
    lp.integrality_ = [highspy.HighsVarType.kInteger if b else highspy.HighsVarType.kContinuous for b in model.integer]
    lp.sense_ = highspy.ObjSense.kMaximize
    return lp


def _solve_highs(model, time_limit_s, starts, settings) -> BackendResult:
    import highspy

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(max(0.1, time_limit_s)))
    h.setOptionValue("threads", int(settings.threads))
    h.setOptionValue("random_seed", int(settings.seed))
    h.setOptionValue("mip_rel_gap", 1e-6)
    h.passModel(_highs_lp(model))
    trace = _watch_highs(h, settings.target)
    best_start = None
    for st in starts:
        val = sum(c * v for c, v in zip(model.obj, st))
        if best_start is None or val > best_start[0]:
            best_start = (val, st)
    if best_start is not None:
        sol = highspy.HighsSolution()
        sol.col_value = list(best_start[1])
        sol.value_valid = True
        h.setSolution(sol)
    h.run()
    info = h.getInfo()
    status = h.modelStatusToString(h.getModelStatus())
    x = None
    obj = 0.0
    if info.primal_solution_status >= 1 or info.mip_gap < float("inf"):
        sol = h.getSolution()
        if sol.value_valid:
            x = list(sol.col_value)
            obj = info.objective_function_value
    return BackendResult(x, obj, info.mip_dual_bound, status, "highs", trace)


def _watch_highs(h, target: float | None) -> list[tuple[float, float]]:
    """Record each improving incumbent (seconds, objective) and stop once one reaches ``target``.

    Returns the trace list the callbacks fill while ``h`` runs.
    """
    t0 = time.monotonic()
    trace: list[tuple[float, float]] = []
    best = {"obj": float("-inf")}

    def on_improve(e):
        v = e.data_out.objective_function_value
        trace.append((time.monotonic() - t0, v))
        best["obj"] = max(best["obj"], v)

    def on_interrupt(e):
        if target is not None and best["obj"] >= target:
            e.interrupt()

    try:
        h.cbMipImprovingSolution.subscribe(on_improve)
        h.cbMipInterrupt.subscribe(on_interrupt)
    except Exception:  # older highspy without the event API: no trace, no early stop
        pass
    return trace


def _solve_cpsat(model, time_limit_s, starts, settings) -> BackendResult:
    """CP-SAT needs integers: continuous columns (flows) are scaled to units of 0.01 tokens/s.

    Their coefficients are integers in our models (flow conservation, sums), so each row is
    multiplied by 100 and the integer columns' coefficients (capacities) are rounded to 0.01
    tokens/s: a proof of optimality holds up to that rounding.
    """
    from ortools.sat.python import cp_model

    scale = 100.0
    m = cp_model.CpModel()
    xs = []
    for j in range(model.num_vars):
        if model.integer[j]:
            xs.append(m.NewIntVar(int(model.lb[j]), int(model.ub[j]), f"x{j}"))
        else:
            xs.append(m.NewIntVar(int(model.lb[j] * scale), int(model.ub[j] * scale), f"x{j}"))
    for coefs, lo, hi in model.rows:
        # Row in real units; continuous columns are scaled, so scale integer coefficients up.
        terms = []
        for j, v in coefs.items():
            if model.integer[j]:
                terms.append((int(round(v * scale)), xs[j]))
            elif float(v).is_integer():
                terms.append((int(v), xs[j]))  # the column is already in units of 1/scale
            else:
                raise ValueError(f"CP-SAT needs integer coefficients on continuous columns ({model.names[j]}: {v})")
        expr = sum(c * x for c, x in terms)
        if lo > -float("inf"):
            m.Add(expr >= int(lo * scale))
        if hi < float("inf"):
            m.Add(expr <= int(hi * scale))
    m.Maximize(sum(int(round(model.obj[j])) * xs[j] for j in range(model.num_vars) if model.obj[j]))
    if starts:
        st = starts[0]
        for j, v in enumerate(st):
            m.AddHint(xs[j], int(round(v if model.integer[j] else v * scale)))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = max(1, settings.threads)
    status = solver.Solve(m)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        x = [solver.Value(v) if model.integer[j] else solver.Value(v) / scale for j, v in enumerate(xs)]
        return BackendResult(x, solver.ObjectiveValue() / scale, solver.BestObjectiveBound() / scale, solver.StatusName(status), "cpsat")
    return BackendResult(None, 0.0, float("inf"), solver.StatusName(status), "cpsat")
