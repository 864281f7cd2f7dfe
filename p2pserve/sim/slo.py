"""Latency SLOs in the simulator: HexGen's metric (ICML'24 §5, after AlpaServe).

A request meets its SLO when it finishes within ``scale`` times its *reference* latency: the time
the whole model takes to serve it alone on one reference GPU (HexGen scales to "the execution
latency of A100 GPUs"), prefill of its prompt plus one decode step per further output token,
with no network. *Attainment* is the share of the requests that arrived in the measurement window
which met their SLO (one that never finished missed it). The figure HexGen reports, and that we
compare layouts by, is the *peak rate within the SLO*: the highest Poisson arrival rate at which
attainment stays at or above ``goal``, found by bisection over rates; its decode tokens/s is the
layout's SLO throughput.

Each probe is one online simulation (:func:`p2pserve.sim.run.simulate`, Poisson arrivals, a
drain after the window so late requests are judged, not dropped). Deterministic for a seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from p2pserve.errors import ConfigError
from p2pserve.placement.profile import LatencyProfile
from p2pserve.sim.metrics import SimResult
from p2pserve.sim.run import SimConfig, simulate
from p2pserve.sim.scenario import Scenario
from p2pserve.sim.workload import load_lengths


@dataclass(frozen=True)
class SloSpec:
    """``scale``: the SLO as a multiple of each request's reference latency; ``goal``: the
    attainment a rate must keep; ``reference``: per-layer profile of the reference GPU;
    ``layers``: the model's layers."""

    reference: LatencyProfile
    layers: int
    scale: float = 5.0
    goal: float = 0.95

    def __post_init__(self) -> None:
        if not (self.scale > 0 and 0 < self.goal <= 1 and self.layers > 0):
            raise ConfigError("an SLO needs scale > 0, 0 < goal <= 1 and a positive layer count")

    def deadline(self, input_len: int, output_len: int) -> float:
        """Seconds the request may take: ``scale`` x (prefill + (output - 1) decode steps) of
        the whole model on the reference GPU."""
        ms = self.reference.prompt_ms(input_len) + max(output_len - 1, 0) * self.reference.decode_ms(1)
        return self.scale * self.layers * ms / 1000.0


def attainment(result: SimResult, spec: SloSpec) -> float:
    """Share of the window's arrivals that finished within their deadline (1.0 if none arrived)."""
    arrived = result.extra.get("arrivals_in_window")
    if arrived is None:
        raise ConfigError("attainment needs an online run (arrivals_in_window)")
    if arrived == 0:
        return 1.0
    met = sum(1 for i, o, lat in result.completions if lat <= spec.deadline(i, o))
    return met / arrived


@dataclass(frozen=True)
class SloPoint:
    """The peak rate found: requests/s, the attainment and decode tokens/s measured there, and
    how many simulations the search ran. ``rate_qps`` (and the decode tokens/s within the SLO) is
    0 when the first probe misses the goal; ``attainment`` is then that probe's."""

    rate_qps: float
    attainment: float
    decode_tokens_per_s: float
    sims: int


@dataclass(frozen=True)
class SloSearch:
    """Bisection settings: the rate bracket (requests/s), the number of halvings of its log
    width, and the simulated window, warm-up and drain (seconds) of each probe."""

    low: float = 0.05
    high: float = 32.0
    steps: int = 7
    duration: float = 120.0
    warmup: float = 30.0
    drain: float = 120.0
    seed: int = 0
    lengths: str = "azure_conv"


def probe(scenario: Scenario, spec: SloSpec, rate_qps: float, search: SloSearch) -> tuple[float, SimResult]:
    """Attainment and the run at ``rate_qps`` Poisson arrivals."""
    inputs, outputs = load_lengths(search.lengths, scenario.root)
    mean_tokens = float(inputs.mean() + outputs.mean())
    cfg = SimConfig(mode="online", arrivals="poisson", token_rate=rate_qps * mean_tokens, duration=search.duration,
                    warmup=search.warmup, drain=search.drain, seed=search.seed, lengths=search.lengths)
    res = simulate(scenario, cfg)
    return attainment(res, spec), res


def peak_rate(scenario: Scenario, spec: SloSpec, search: SloSearch = SloSearch(), at_least: float = 0.0) -> SloPoint:
    """The highest rate in ``[search.low, search.high]`` whose attainment is >= ``spec.goal``.

    ``at_least``: a rate to beat (a search's incumbent). It is probed first; if it misses the
    goal the answer is below it and only that one probe is spent (returned with ``rate_qps``
    0), which keeps a grouping search cheap for candidates that lose.
    """
    lo, hi = (at_least, search.high) if at_least > 0 else (search.low, search.high)
    a, r = probe(scenario, spec, lo, search)
    sims = 1
    if a < spec.goal:
        return SloPoint(0.0, a, 0.0, sims)
    best = SloPoint(lo, a, r.decode_throughput_tokens_per_s, sims)
    for _ in range(search.steps):
        mid = math.sqrt(lo * hi)
        a, r = probe(scenario, spec, mid, search)
        sims += 1
        if a >= spec.goal:
            lo, best = mid, SloPoint(mid, a, r.decode_throughput_tokens_per_s, sims)
        else:
            hi = mid
    return SloPoint(best.rate_qps, best.attainment, best.decode_tokens_per_s, sims)

