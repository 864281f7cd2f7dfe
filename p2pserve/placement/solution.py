"""The planner's result (:class:`Solution`) and the checks every placement must pass.

Not the wire plan peers follow (``p2pserve.dht.records.Plan``): a :class:`Solution` is in node
indices of one :class:`~p2pserve.placement.topology.Topology`, with the solver's bounds and
estimates attached; the coordinator turns it into the wire plan.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Mapping

from p2pserve.errors import InsufficientMemoryError
from p2pserve.placement.estimate import ThroughputEstimate
from p2pserve.placement.topology import Topology
from p2pserve.types import SINK_INDEX, SOURCE_INDEX


@dataclass(frozen=True)
class Solution:
    """A placement the planner chose and what it is expected to deliver.

    ``assignments``: node index -> [start, end). ``flows``: (u, v) -> tokens/s on each used edge
    (``SOURCE_INDEX`` = -1, ``SINK_INDEX`` = -2). ``max_flow`` / ``upper_bound`` in tokens/s (prompt and
    decode tokens together, Helix's unit). ``solver_gap``: (bound - max_flow) / bound with the
    tightest bound known (the MILP's dual bound when it ran, else the covering bound).
    """

    assignments: dict[int, tuple[int, int]]
    node_names: dict[int, str]
    flows: dict[tuple[int, int], float]
    max_flow: float
    upper_bound: float
    covering_bound: float
    solver_bound: float
    solver_gap: float
    solve_time_s: float
    objective: str
    method: str
    estimate: ThroughputEstimate
    warnings: tuple[str, ...] = ()
    stats: dict = field(default_factory=dict)

    @property
    def layers_held(self) -> int:
        """Total layers loaded across nodes."""
        return sum(e - s for s, e in self.assignments.values())

    def to_json(self) -> dict:
        """JSON-ready dict (the CLI's ``--json`` output)."""
        est = asdict(self.estimate)
        return {
            "objective": self.objective,
            "method": self.method,
            "max_flow_tokens_per_s": self.max_flow,
            "upper_bound_tokens_per_s": self.upper_bound,
            "covering_bound_tokens_per_s": self.covering_bound,
            "solver_bound_tokens_per_s": self.solver_bound,
            "solver_gap": self.solver_gap,
            "solve_time_s": self.solve_time_s,
            "estimated_decode_tokens_per_s": self.estimate.decode_tokens_per_s,
            "estimated_per_token_latency_s": self.estimate.per_token_latency_s,
            "mean_depth": self.estimate.mean_depth,
            "max_depth": self.estimate.max_depth,
            "estimate": est,
            "assignments": {
                self.node_names.get(i, str(i)): [s, e] for i, (s, e) in sorted(self.assignments.items())
            },
            "assignments_by_index": {str(i): [s, e] for i, (s, e) in sorted(self.assignments.items())},
            "flows": [
                {"from": _end_name(u, self.node_names), "to": _end_name(v, self.node_names), "tokens_per_s": f}
                for (u, v), f in sorted(self.flows.items())
            ],
            "warnings": list(self.warnings),
            "stats": self.stats,
        }


def _end_name(i: int, names: Mapping[int, str]) -> str:
    if i == SOURCE_INDEX:
        return "source"
    if i == SINK_INDEX:
        return "sink"
    return names.get(i, str(i))


def check_memory(topo: Topology) -> None:
    """Raise :class:`InsufficientMemoryError` if all nodes together cannot hold every layer."""
    L = topo.num_layers
    have = topo.total_memory_layers()
    if have >= L:
        return
    missing_layers = L - have
    per = topo.layer_bytes
    if per > 0:
        raise InsufficientMemoryError(
            f"the swarm can hold {have} of {L} layers: {missing_layers} layers "
            f"({missing_layers * per / 1e9:.1f} GB at {per / 1e9:.2f} GB per layer) of memory are missing"
        )
    raise InsufficientMemoryError(f"the swarm can hold {have} of {L} layers: {missing_layers} layers are missing")


def validate_placement(topo: Topology, placement: Mapping[int, tuple[int, int]]) -> list[str]:
    """Problems with a placement (empty list = valid): ranges, memory, coverage."""
    problems = []
    L = topo.num_layers
    covered = [False] * L
    for i, (s, e) in placement.items():
        if not (0 <= i < topo.num_nodes):
            problems.append(f"unknown node {i}")
            continue
        if not (0 <= s < e <= L):
            problems.append(f"node {i}: bad range [{s}, {e})")
            continue
        if e - s > topo.nodes[i].max_layers:
            problems.append(f"node {i}: {e - s} layers exceed its memory ({topo.nodes[i].max_layers})")
        for l in range(s, e):
            covered[l] = True
    missing = [l for l in range(L) if not covered[l]]
    if missing:
        problems.append(f"layers not covered: {missing[:10]}{'...' if len(missing) > 10 else ''}")
    return problems
