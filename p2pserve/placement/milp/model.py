"""The Helix §4.4 MILP (Tables 5-6) as a solver-neutral :class:`LinearModel`, and placements in and out.

Variables per node i: ``s_i`` (first layer, integer), ``b_i^k`` (holds k layers, binary).
Per kept directed edge (u, v): ``f_uv`` (flow, continuous), ``d_uv`` (edge valid, binary) and,
between compute nodes, ``c1_uv`` (``s_v <= e_u``) and ``c2_uv`` (``e_u < e_v``).
Maximise the flow out of the source.

Improvements over the paper's formulation (each can be switched off in :class:`MilpOptions`):

* ``tight_big_m``: ``f_uv <= d_uv * min(S_uv, max T_u, max T_v)`` instead of ``d_uv * S_uv``.
  A 1 Gbps link is worth 61,035 tokens/s while no node exceeds ~24k, so the paper's bound lets
  the LP relaxation route flow over edges at d ~ 0.3; ours forces d close to 1.
* ``d <= c1`` and ``d <= c2`` instead of ``d <= (c1 + c2) / 2`` (same integer points, tighter LP).
* ``node_cap_flow``: ``f_uv <= sum_k b_u^k T_u(k)`` per edge (out-flow of u on one edge cannot
  exceed u's capacity) -- a cheap valid cut.
* ``symmetry``: identical nodes (same T table, same link capacities) get ``s_i <= s_j`` for
  i < j, which removes the n! relabelings branch-and-bound would otherwise explore.
* ``layer_pass_cut``: ``L * sum f_source <= sum_i sum_k k T_i(k) b_i^k`` (every token needs L
  layer passes; node i does at most k T_i(k) of them per second) and ``sum_i k_i >= L``. Without
  it the LP bound on cluster24 is ~1e5 tokens/s, 40x the true optimum.
* edge pruning (Helix §4.5): keep, per node, only its fastest ``keep_edges_per_node`` outgoing
  links and drop links below ``prune_below_tokens_per_s``.
* warm start from any placement (the flows come from max-flow), and early stop once the
  incumbent reaches ``(1 - early_stop_gap) * upper_bound``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from p2pserve.placement.maxflow import max_flow
from p2pserve.placement.milp.linear import LinearModel
from p2pserve.placement.topology import Topology
from p2pserve.types import SINK_INDEX, SOURCE_INDEX


@dataclass(frozen=True)
class MilpOptions:
    """Switches for the formulation and the solve (see module docstring)."""

    partial: bool = True
    tight_big_m: bool = True
    tight_validity: bool = True
    node_cap_flow: bool = True
    symmetry: bool = True
    layer_pass_cut: bool = True
    keep_edges_per_node: int | None = None
    prune_below_tokens_per_s: float = 0.0
    early_stop_gap: float = 0.0
    threads: int = 2  # the churn bound's solves use the same count (see move_bound)
    seed: int = 0


@dataclass
class PlacementModel:
    """The MILP plus the index maps needed to read placements in and out of it."""

    model: LinearModel
    s: dict[int, int]
    b: dict[int, dict[int, int]]
    f: dict[tuple[int, int], int]
    d: dict[tuple[int, int], int]
    c1: dict[tuple[int, int], int]
    c2: dict[tuple[int, int], int]
    edges: list[tuple[int, int, float]]

    def end_coefs(self, i: int, sign: float) -> dict[int, float]:
        """Coefficients of ``sign * e_i`` where ``e_i = s_i + sum_k k b_i^k`` (node i's end)."""
        c = {self.s[i]: sign}
        for k, var in self.b[i].items():
            c[var] = c.get(var, 0.0) + sign * k
        return c


def kept_edges(topo: Topology, opts: MilpOptions) -> list[tuple[int, int, float]]:
    """Directed edges ``(u, v, capacity)`` left after pruning (source/sink edges always kept)."""
    n = topo.num_nodes
    out: list[tuple[int, int, float]] = []
    for i in range(n):
        c = topo.capacity(SOURCE_INDEX, i)
        if c > 0:
            out.append((SOURCE_INDEX, i, c))
        c = topo.capacity(i, SINK_INDEX)
        if c > 0:
            out.append((i, SINK_INDEX, c))
    for i in range(n):
        cand = []
        for j in range(n):
            if i == j:
                continue
            c = topo.capacity(i, j)
            if c > 0 and c >= opts.prune_below_tokens_per_s:
                cand.append((c, j))
        cand.sort(key=lambda x: -x[0])
        if opts.keep_edges_per_node is not None:
            cand = cand[: opts.keep_edges_per_node]
        out.extend((i, j, c) for c, j in cand)
    return out


def identical_groups(topo: Topology) -> list[list[int]]:
    """Groups of interchangeable nodes: same T table and same capacity to every other node."""
    n = topo.num_nodes
    sig: dict[tuple, list[int]] = {}
    for i in range(n):
        links = tuple(
            (round(topo.capacity(i, j), 6), round(topo.capacity(j, i), 6)) for j in range(n) if j != i
        )
        # Compare link rows ignoring the i/j self position: use sorted multiset plus endpoints.
        key = (
            topo.nodes[i].throughput,
            round(topo.capacity(SOURCE_INDEX, i), 6),
            round(topo.capacity(i, SINK_INDEX), 6),
            tuple(sorted(links)),
        )
        sig.setdefault(key, []).append(i)
    groups = []
    for members in sig.values():
        if len(members) < 2:
            continue
        # Only truly interchangeable if pairwise swapping keeps all capacities: check rows.
        base = members[0]
        ok = [base]
        for j in members[1:]:
            same = all(
                abs(topo.capacity(base, x) - topo.capacity(j, x)) < 1e-6
                and abs(topo.capacity(x, base) - topo.capacity(x, j)) < 1e-6
                for x in range(n)
                if x not in (base, j)
            )
            if same:
                ok.append(j)
        if len(ok) >= 2:
            groups.append(ok)
    return groups


def build_model(topo: Topology, opts: MilpOptions = MilpOptions()) -> PlacementModel:
    """Build the §4.4 MILP for ``topo`` with the options' improvements.

    Columns and rows are added in a fixed order (nodes, then edges, then per-node rows, then
    the cuts): a solver's path, and so what it finds within a time limit, depends on it.
    """
    m = LinearModel()
    pm = PlacementModel(m, {}, {}, {}, {}, {}, {}, kept_edges(topo, opts))
    tmax = _node_columns(pm, topo)
    for u, v, cap in pm.edges:
        _edge_rows(pm, topo, opts, u, v, min(cap, tmax[u], tmax[v]) if opts.tight_big_m else cap)
    for i in range(topo.num_nodes):
        _node_rows(pm, topo, opts, i)
    if opts.layer_pass_cut:
        _layer_pass_rows(pm, topo)
    if opts.symmetry:
        for group in identical_groups(topo):
            for a, c in zip(group, group[1:]):
                m.row({pm.s[a]: 1.0, pm.s[c]: -1.0}, hi=0.0)
    return pm


def _node_columns(pm: PlacementModel, topo: Topology) -> dict[int, float]:
    """``s_i`` and ``b_i^k`` per node with their rows; returns each node's best throughput."""
    m, L = pm.model, topo.num_layers
    tmax: dict[int, float] = {}
    for i in range(topo.num_nodes):
        node = topo.nodes[i]
        K = min(node.max_layers, L)
        pm.s[i] = m.var(f"s_{i}", 0, L - 1, True)
        pm.b[i] = {k: m.var(f"b_{i}_{k}", 0, 1, True) for k in range(1, K + 1)}
        tmax[i] = max(node.throughput[1 : K + 1], default=0.0)
        # exactly one size (every node holds something, as in the paper)
        m.row({pm.b[i][k]: 1.0 for k in pm.b[i]}, 1.0, 1.0)
        m.row(pm.end_coefs(i, 1.0), -float("inf"), float(L))  # e_i = s_i + sum k b_i^k <= L
    tmax[SOURCE_INDEX] = tmax[SINK_INDEX] = float("inf")
    return tmax


def _edge_rows(pm: PlacementModel, topo: Topology, opts: MilpOptions, u: int, v: int, big: float) -> None:
    """Flow ``f_uv``, validity ``d_uv`` and the rows tying them to the two nodes' ranges."""
    m, L = pm.model, topo.num_layers
    f = pm.f[(u, v)] = m.var(f"f_{u}_{v}", 0, big, False, obj=1.0 if u == SOURCE_INDEX else 0.0)
    d = pm.d[(u, v)] = m.var(f"d_{u}_{v}", 0, 1, True)
    m.row({f: 1.0, d: -big}, hi=0.0)  # f <= d * S
    if u == SOURCE_INDEX:
        m.row({pm.s[v]: 1.0, d: float(L)}, hi=float(L))  # s_v <= L (1 - d)
    elif v == SINK_INDEX:
        c = pm.end_coefs(u, 1.0)
        c[d] = c.get(d, 0.0) - L
        m.row(c, lo=0.0)  # L d <= e_u
    elif opts.partial:
        _partial_rows(pm, opts, u, v, L)
    else:
        # no partial inference: d = 1 only if e_u == s_v
        c = pm.end_coefs(u, -1.0)
        c[pm.s[v]] = c.get(pm.s[v], 0.0) + 1.0
        c[d] = float(L)
        m.row(c, hi=float(L))  # L d <= L + s_v - e_u
        c = pm.end_coefs(u, 1.0)
        c[pm.s[v]] = c.get(pm.s[v], 0.0) - 1.0
        c[d] = float(L)
        m.row(c, hi=float(L))  # L d <= L - s_v + e_u


def _partial_rows(pm: PlacementModel, opts: MilpOptions, u: int, v: int, L: int) -> None:
    """Partial inference: ``d_uv`` only if ``s_v <= e_u`` (``c1``) and ``e_u < e_v`` (``c2``)."""
    m, d = pm.model, pm.d[(u, v)]
    c1 = pm.c1[(u, v)] = m.var(f"c1_{u}_{v}", 0, 1, True)
    c2 = pm.c2[(u, v)] = m.var(f"c2_{u}_{v}", 0, 1, True)
    # (L+1)(1 - c1) >= s_v - e_u   <=>   s_v - e_u + (L+1) c1 <= L+1
    c = pm.end_coefs(u, -1.0)
    c[pm.s[v]] = c.get(pm.s[v], 0.0) + 1.0
    c[c1] = float(L + 1)
    m.row(c, hi=float(L + 1))
    # e_v - e_u >= 1 - (L+1)(1 - c2)   <=>   e_v - e_u - (L+1) c2 >= -L
    c = pm.end_coefs(v, 1.0)
    for var, val in pm.end_coefs(u, -1.0).items():
        c[var] = c.get(var, 0.0) + val
    c[c2] = -float(L + 1)
    m.row(c, lo=-float(L))
    if opts.tight_validity:
        m.row({d: 1.0, c1: -1.0}, hi=0.0)
        m.row({d: 1.0, c2: -1.0}, hi=0.0)
    else:
        m.row({d: 1.0, c1: -0.5, c2: -0.5}, hi=0.0)


def _node_rows(pm: PlacementModel, topo: Topology, opts: MilpOptions, i: int) -> None:
    """Flow conservation through node ``i`` and its throughput cap (per edge too, if asked)."""
    m, f = pm.model, pm.f
    ins = [f[(u, v)] for (u, v) in f if v == i]
    outs = [f[(u, v)] for (u, v) in f if u == i]
    c = {x: 1.0 for x in ins}
    for x in outs:
        c[x] = c.get(x, 0.0) - 1.0
    m.row(c, 0.0, 0.0)  # conservation
    cap = {x: 1.0 for x in ins}
    for k, var in pm.b[i].items():
        cap[var] = -topo.nodes[i].throughput[k]
    m.row(cap, hi=0.0)  # inference throughput
    if opts.node_cap_flow:
        for x in outs:
            cc = {x: 1.0}
            for k, var in pm.b[i].items():
                cc[var] = -topo.nodes[i].throughput[k]
            m.row(cc, hi=0.0)


def _layer_pass_rows(pm: PlacementModel, topo: Topology) -> None:
    """``L * sum f_source <= sum_i sum_k k T_i(k) b_i^k`` and ``sum_i k_i >= L``."""
    L = topo.num_layers
    c = {pm.f[(u, v)]: float(L) for (u, v) in pm.f if u == SOURCE_INDEX}
    cover = {}
    for i in range(topo.num_nodes):
        for k, var in pm.b[i].items():
            c[var] = -k * topo.nodes[i].throughput[k]
            cover[var] = float(k)
    pm.model.row(c, hi=0.0)
    pm.model.row(cover, lo=float(L))


def canonical_for_symmetry(topo: Topology, placement: Mapping[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """Relabel identical nodes so that starts are non-decreasing (matches the symmetry rows)."""
    out = dict(placement)
    for group in identical_groups(topo):
        ranges = sorted(out[i] for i in group if i in out)
        missing = [i for i in group if i not in out]
        if missing:
            continue
        for i, r in zip(group, ranges):
            out[i] = r
    return out


def solution_vector(pm: PlacementModel, topo: Topology, placement: Mapping[int, tuple[int, int]], partial: bool) -> list[float]:
    """A full, feasible column vector for ``placement`` (flows from max-flow on kept edges)."""
    L = topo.num_layers
    x = [0.0] * pm.model.num_vars
    for i in range(topo.num_nodes):
        start, end = placement[i]
        x[pm.s[i]] = start
        x[pm.b[i][end - start]] = 1.0
    kept = {(u, v) for u, v, _ in pm.edges}
    flows = max_flow(topo, placement, partial).edge_flows
    for (u, v) in pm.f:
        if u == SOURCE_INDEX:
            valid = placement[v][0] == 0
        elif v == SINK_INDEX:
            valid = placement[u][1] == L
        else:
            su, eu = placement[u]
            sv, ev = placement[v]
            valid = (sv <= eu < ev) if partial else (eu == sv)
            if partial:
                x[pm.c1[(u, v)]] = 1.0 if sv <= eu else 0.0
                x[pm.c2[(u, v)]] = 1.0 if eu < ev else 0.0
        x[pm.d[(u, v)]] = 1.0 if valid else 0.0
        if (u, v) in kept and valid:
            x[pm.f[(u, v)]] = flows.get((u, v), 0.0)
    return x


def read_placement(pm: PlacementModel, topo: Topology, x: list[float]) -> dict[int, tuple[int, int]]:
    """Placement from a column vector."""
    out = {}
    for i in range(topo.num_nodes):
        k = max(pm.b[i], key=lambda kk: x[pm.b[i][kk]])
        start = int(round(x[pm.s[i]]))
        out[i] = (start, start + k)
    return out
