"""What a run measures: decode throughput in a window and latency distributions."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass(frozen=True)
class Distribution:
    """Summary of a latency sample in seconds (NaN when empty)."""

    mean: float
    p50: float
    p95: float
    count: int

    @classmethod
    def of(cls, values: list[float]) -> "Distribution":
        """Summarise ``values``."""
        if not values:
            nan = float("nan")
            return cls(nan, nan, nan, 0)
        a = np.asarray(values, dtype=np.float64)
        p50, p95 = np.percentile(a, [50, 95])
        return cls(float(a.mean()), float(p50), float(p95), int(a.size))


class Recorder:
    """Collects per-job events that complete inside the measurement window ``[t0, t1]``."""

    __slots__ = ("t0", "t1", "decode_tokens", "prompt_lat", "decode_lat", "prompts", "finished", "completions")

    def __init__(self, t0: float, t1: float) -> None:
        self.t0 = t0
        self.t1 = t1
        self.decode_tokens = 0
        self.prompt_lat: list[float] = []
        self.decode_lat: list[float] = []
        self.prompts = 0
        self.finished = 0
        # (input_len, output_len, end-to-end latency s) of queries that *arrived* in the window,
        # whenever they finish: what a latency SLO is judged on (p2pserve.sim.slo).
        self.completions: list[tuple[int, int, float]] = []

    def prompt(self, now: float, latency: float) -> None:
        """A prompt job reached the sink ``latency`` s after its query arrived."""
        if self.t0 <= now <= self.t1:
            self.prompts += 1
            self.prompt_lat.append(latency)

    def decode(self, now: float, latency: float, tokens: int = 1) -> None:
        """A decode job reached the sink after ``latency`` s on its route, yielding ``tokens``
        output tokens (more than one: a speculative verify step)."""
        if self.t0 <= now <= self.t1:
            self.decode_tokens += tokens
            self.decode_lat.append(latency)

    def finish(self, now: float, query=None) -> None:
        """A query produced its last token (``query``: a :class:`~p2pserve.sim.request.Query`)."""
        if self.t0 <= now <= self.t1:
            self.finished += 1
        if query is not None and self.t0 <= query.arrival <= self.t1:
            self.completions.append((query.input_len, query.output_len, now - query.arrival))


@dataclass
class SimResult:
    """Outcome of one simulation run (JSON-friendly through :meth:`to_dict`)."""

    decode_throughput_tokens_per_s: float
    prompt_latency_s: Distribution
    decode_latency_s: Distribution
    window_s: float
    queries_submitted: int
    queries_finished_in_window: int
    queries_waiting_at_end: int
    simulated_s: float
    wall_s: float
    events: int
    avg_route_depth: float
    node_utilization: dict[int, float] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    #: (input_len, output_len, latency s) of queries that arrived in the window and finished
    #: before the run ended (``Recorder.completions``); not in :meth:`to_dict`.
    completions: list = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        """Plain-dict view for ``--json``."""
        out = asdict(self)
        out.pop("completions")
        out["node_utilization"] = {str(k): v for k, v in self.node_utilization.items()}
        return out
