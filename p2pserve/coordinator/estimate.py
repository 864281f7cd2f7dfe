"""Depth-, latency- and KV-aware estimate of the decode throughput a placement serves.

Why max-flow alone is wrong: in Helix's own simulator a 24-hop chain on cluster24 has max-flow
2,045.6 yet serves 220 decode tokens/s, less than the 1,289.6 placement's 252. Offline serving
is *closed-loop*: a request sends its next token only after the previous one crossed the whole
pipeline, and the number of requests in flight is capped by the KV cache. So (Little's law)

    decode tokens/s  X = N / tau(X)

* ``N`` -- requests in flight. Each reserves ``(input + reserved_output)`` KV entries on every
  layer it runs; admission stops when the least-provisioned layer is ``kv_fill`` full, so
  ``N = kv_fill * min_l sum_{i holds l} kv_i / k_i / (input + reserved_output)``; a node whose
  share of the flow outgrows its own KV caps ``N`` too (its high-water mark).
* ``tau(X)`` -- time for one token to cross its pipeline, flow-weighted over the max-flow's
  paths. At node i the per-layer queues are served round-robin; with ``x_i = X * flow_i / F``
  decode tokens/s (plus ``input/output`` times as many prompt tokens) arriving, one round over
  its k layers lasts ``c = k * (D(x_i c) + P(rho x_i c))`` (solved by fixed-point iteration;
  no solution = the node is saturated). A token spends ``visit_cycles * c`` at the node, plus
  the link latency and activation transfer of each hop.
* ``X`` also cannot exceed the max-flow's decode share ``F * output / (input + output)``.

The prompt phase holds KV too but produces no decode tokens: ``N`` is scaled by the share of a
request's life spent decoding, which we estimate from the same per-node cycle times.

All inputs come from the topology (profiles, KV capacities, link latencies): no simulator.
The constants of :class:`WorkloadModel` were calibrated against the project's simulator
(``p2pserve/sim``) on Helix's, Petals', Swarm's and chain placements; see docs/planner.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from p2pserve.coordinator.maxflow import FlowResult, max_flow
from p2pserve.coordinator.topology import SINK, SOURCE, Topology


@dataclass(frozen=True)
class WorkloadModel:
    """Workload and serving constants of the estimate (defaults: Helix offline, Azure conv)."""

    avg_input: float = 763.0
    avg_output: float = 232.0
    reserved_output: float = 240.0  # KV reserved per request for its output (ratio 1.0)
    kv_fill: float = 0.8  # admission stops at this usage of the least-provisioned layer
    node_hwm: float = 0.85  # per-node reservation high-water mark
    visit_cycles: float = 1.5  # a token waits ~half a round, then runs its layers
    hop_overhead_s: float = 0.0  # extra per hop beyond link latency + transfer (RPC costs)
    entry_bytes_per_s: float = 1.0 / (1.0 / 4e9 + 1.0 / 5e9)  # Helix's first-layer overhead


@dataclass(frozen=True)
class ThroughputEstimate:
    """What a placement is expected to serve (see module docstring)."""

    decode_tokens_per_s: float
    per_token_latency_s: float
    concurrency: float
    kv_layer_capacity_tokens: float
    compute_bound_decode_tokens_per_s: float
    mean_depth: float
    max_depth: int
    paths: int


def flow_paths(flow: FlowResult) -> list[tuple[list[int], float]]:
    """Decompose edge flows into source->sink paths ``(nodes, flow)`` (largest first)."""
    rem = dict(flow.edge_flows)
    out_edges: dict[int, list[int]] = {}
    for (u, v) in rem:
        out_edges.setdefault(u, []).append(v)
    paths = []
    for _ in range(10000):
        path, u = [], SOURCE
        bottleneck = float("inf")
        seen = set()
        while u != SINK:
            nxt = [v for v in out_edges.get(u, []) if rem.get((u, v), 0.0) > 1e-6]
            if not nxt or u in seen:
                path = []
                break
            seen.add(u)
            v = max(nxt, key=lambda x: rem[(u, x)])
            bottleneck = min(bottleneck, rem[(u, v)])
            if v != SINK:
                path.append(v)
            u = v
        if not path or bottleneck == float("inf") or bottleneck <= 1e-6:
            break
        prev = SOURCE
        for v in path + [SINK]:
            rem[(prev, v)] -= bottleneck
            prev = v
        paths.append((path, bottleneck))
    return paths


def _cycle_time_s(
    topo: Topology, i: int, k: int, decode_rate: float, prompt_ratio: float, entry_s_per_token: float = 0.0
) -> float:
    """Round time over node i's k layers at ``decode_rate`` tokens/s (inf if saturated).

    ``entry_s_per_token`` is the per-token cost of receiving a batch into the first layer
    (concatenation/copy), paid once per round for everything that arrived during it.
    """
    node = topo.nodes[i]
    prof = node.profile
    if prof is None:
        # No latency profile: fall back to the throughput table (tokens/s for k layers).
        t = node.throughput[k] if k < len(node.throughput) else 0.0
        if t <= 0:
            return float("inf")
        util = decode_rate * (1.0 + prompt_ratio) / t
        return float("inf") if util >= 1.0 else (k / t) / (1.0 - util)
    cap = node.decode_max_tokens[k] if k < len(node.decode_max_tokens) and node.decode_max_tokens[k] else 0

    def layer_ms(dec: float, pro: float) -> float:
        if cap and dec > cap:
            d = (dec / cap) * prof.decode_ms(cap)
        else:
            d = prof.decode_ms(max(dec, 1.0)) if dec > 0 else 0.0
        return d + (prof.prompt_ms(pro) if pro > 0 else 0.0)

    def round_s(c: float) -> float:
        arrived = decode_rate * c
        return k * layer_ms(arrived, prompt_ratio * arrived) / 1000.0 + entry_s_per_token * arrived * (1 + prompt_ratio)

    c = k * layer_ms(1.0, 0.0) / 1000.0
    for _ in range(60):
        nc = round_s(c)
        if nc > 60.0:
            return float("inf")
        if abs(nc - c) < 1e-6 * max(c, 1e-6):
            c = nc
            break
        c = nc
    # Converged to a fixed point only if the round is not growing faster than its load.
    probe = round_s(c * 1.01)
    if probe >= c * 1.01:
        return float("inf")
    return c


def kv_layer_capacity(topo: Topology, placement: Mapping[int, tuple[int, int]]) -> float:
    """Tokens the least-provisioned layer can cache: min_l sum_{i holds l} kv_i / k_i."""
    per = [0.0] * topo.num_layers
    for i, (s, e) in placement.items():
        k = e - s
        kv = topo.nodes[i].kv_capacity
        cap = kv[k] if k < len(kv) else 0
        for l in range(s, e):
            per[l] += cap / k
    return min(per) if per else 0.0


def estimate(
    topo: Topology,
    placement: Mapping[int, tuple[int, int]],
    flow: FlowResult | None = None,
    model: WorkloadModel = WorkloadModel(),
    partial: bool = True,
    _probe: list | None = None,
) -> ThroughputEstimate:
    """Estimate decode throughput, per-token latency and depth for ``placement``."""
    placement = {i: r for i, r in placement.items() if r[1] > r[0]}
    if flow is None:
        flow = max_flow(topo, placement, partial)
    F = flow.value
    if F <= 0:
        return ThroughputEstimate(0.0, float("inf"), 0.0, 0.0, 0.0, 0.0, 0, 0)
    paths = flow_paths(flow)
    depth_w = sum(len(p) * f for p, f in paths)
    total_w = sum(f for _, f in paths) or 1.0
    mean_depth = depth_w / total_w
    max_depth = max((len(p) for p, _ in paths), default=0)
    I, O = model.avg_input, model.avg_output
    per_req = I + model.reserved_output
    kv_cap = kv_layer_capacity(topo, placement)
    n_kv = model.kv_fill * kv_cap / per_req
    # Per-node high-water mark: node i sees a share flow_i/F of the requests.
    for i, f_i in flow.node_flows.items():
        if f_i <= 1e-9:
            continue
        s, e = placement[i]
        k = e - s
        kv = topo.nodes[i].kv_capacity
        cap = kv[k] if k < len(kv) else 0
        if cap > 0:
            n_kv = min(n_kv, model.node_hwm * cap / (per_req * k) * F / f_i)
    share = {i: f / F for i, f in flow.node_flows.items() if f > 1e-9}
    rho = I / O
    compute_bound = F * O / (I + O)

    entry = topo.activation_bytes / model.entry_bytes_per_s
    hop_lat, hop_sec_per_token = {}, {}
    for p, _f in paths:
        prev = SOURCE
        for v in p + [SINK]:
            if (prev, v) not in hop_lat:
                lat = topo.latency(prev, v)
                link = topo.link(prev, v)
                bw = topo.convention.bytes_per_s(link.bandwidth) if link else 0.0
                size = topo.token_bytes if (prev == SOURCE or v == SINK) else topo.activation_bytes
                hop_lat[(prev, v)] = lat if lat != float("inf") else 0.0
                hop_sec_per_token[(prev, v)] = size / bw if bw > 0 else 0.0
            prev = v
    edge_share = {key: f / F for key, f in flow.edge_flows.items()}

    def tau(X: float) -> tuple[float, float]:
        """(decode per-token latency, prompt latency) at decode throughput X."""
        cyc = {}
        for i, sh in share.items():
            s, e = placement[i]
            cyc[i] = _cycle_time_s(topo, i, e - s, X * sh, rho, entry)
            if cyc[i] == float("inf"):
                return float("inf"), float("inf")
        t_dec = t_pro = 0.0
        for p, f in paths:
            links = 0.0
            prev = SOURCE
            for v in p + [SINK]:
                # A link sends one batch at a time: a token waits for its whole batch (the
                # tokens the upstream node emitted in one round, prompts included).
                batch = X * edge_share.get((prev, v), 0.0) * (1 + rho) * (cyc[prev] if prev in cyc else 0.0)
                links += hop_lat[(prev, v)] + hop_sec_per_token[(prev, v)] * max(batch, 1.0)
                links += model.hop_overhead_s if v != SINK else 0.0
                prev = v
            comp = sum(cyc[i] for i in p)
            t_dec += f * (model.visit_cycles * comp + links)
            t_pro += f * (model.visit_cycles * comp + links + I * entry * len(p))
        return t_dec / total_w, t_pro / total_w

    def achievable(X: float) -> tuple[bool, float]:
        td, tp = tau(X)
        if td == float("inf"):
            return False, td
        decode_share = O * td / (O * td + tp)
        return X * td <= n_kv * decode_share, td

    if _probe is not None:
        _probe.append(tau)
    lo, hi = 0.0, compute_bound
    ok, td = achievable(hi)
    if ok:
        lo = hi
    else:
        for _ in range(40):
            mid = (lo + hi) / 2
            ok, _td = achievable(mid)
            if ok:
                lo = mid
            else:
                hi = mid
    td, _tp = tau(lo) if lo > 0 else tau(1e-6)
    return ThroughputEstimate(
        decode_tokens_per_s=lo,
        per_token_latency_s=td,
        concurrency=n_kv,
        kv_layer_capacity_tokens=kv_cap,
        compute_bound_decode_tokens_per_s=compute_bound,
        mean_depth=mean_depth,
        max_depth=max_depth,
        paths=len(paths),
    )
