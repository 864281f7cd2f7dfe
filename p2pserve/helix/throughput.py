"""The authors' node-throughput formula: ``T_i(k)``, tokens/s of node i holding k layers.

Re-implemented from the description in the data README (``p2pserve/helix/data/README.md``): the
rate of a "typical" mixed prompt+decode batch, whose mix depends on the cluster's composition
through the average per-layer time. It reproduces ``node_throughput/*.json`` (the MILP inputs
the authors used) for their clusters.
"""

from __future__ import annotations

import json
from pathlib import Path

from p2pserve.helix.root import data_root
from p2pserve.helix.format import (
    HelixCluster,
    MachineParams,
    canonical_type,
    load_machine_params,
    load_profile,
)
from p2pserve.placement.profile import LatencyProfile


def _mixed_batch_throughput(
    prof: LatencyProfile, mp: MachineParams, gpu: str, k: int, ratio: float
) -> float:
    """Tokens/s of the authors' "typical" mixed prompt+decode batch for a node holding k layers."""
    I, O = mp.avg_input_len, mp.avg_output_len
    kv = mp.kv_capacity(gpu, k)
    avail = int(mp.kv_cache_hwm * kv / k)
    pr = avail / (I + O) * ratio / O
    if pr > 1:
        pr, pt, dt = 1.0, I, O
    else:
        pt = round(pr * I)
        dt = round(avail / (I + O) * ratio)
    if pr >= 1:
        ms = k * (prof.prompt_ms(pt) + prof.decode_ms(dt))
        return (pt + dt) / ms * 1000.0
    rho = 1.0 / pr
    ms = k * (prof.prompt_ms(int(pt * rho)) + rho * prof.decode_ms(dt))
    return rho * (pt + dt) / ms * 1000.0


def throughput_table(
    model: str, node_types: list[str], nic_bytes_per_s: float | None = None, root: Path | None = None
) -> dict[str, list[float]]:
    """T[k] per GPU type present in a cluster with these ``node_types`` (authors' formula).

    Returns type -> list where index k (1..max_num_layers) is tokens/s holding k layers and
    index 0 is 0. The result depends on the cluster composition through the average per-layer
    time ``t̄`` (see README), so pass the full list of node types.
    """
    mp = load_machine_params(model, root)
    L = mp.num_layers
    counts: dict[str, int] = {}
    for t in node_types:
        key = canonical_type(t, mp.gpus)
        counts[key] = counts.get(key, 0) + 1
    # The authors switch to the larger "typical #layers" table when the cluster, loaded with the
    # default typical counts, would hold fewer than 1.2 model copies (verified against their
    # cluster10 and cluster24 tables; single-type clusters do not depend on the choice).
    typical_capacity = sum(mp.typical_layers_default[t] * n for t, n in counts.items())
    typical = mp.typical_layers_small if typical_capacity < 1.2 * L else mp.typical_layers_default
    perf = {t: mp.initial_normalized_perf[t] for t in counts}
    profs = {t: load_profile(model, t, root) for t in counts}

    def tables(perf_now: dict[str, float]) -> dict[str, list[float]]:
        num = sum(counts[t] * typical[t] * (1.0 / perf_now[t]) for t in counts)
        den = sum(counts[t] * typical[t] for t in counts)
        tbar = num / den
        out = {}
        for t in counts:
            tm = 1.0 / perf_now[t]
            row = [0.0]
            for k in range(1, mp.gpus[t].max_num_layers + 1):
                r = k * tm / ((L - k) * tbar + k * tm)
                row.append(_mixed_batch_throughput(profs[t], mp, t, k, r))
            out[t] = row
        return out

    for _ in range(10):
        cur = tables(perf)
        perf = {t: cur[t][min(typical[t], len(cur[t]) - 1)] * typical[t] for t in counts}
    final = tables(perf)
    if nic_bytes_per_s is None:
        nic_bytes_per_s = 10e9  # every GPU type in machine_profiles.ini has a 10 Gbps NIC
    cap = nic_bytes_per_s / mp.activation_size_bytes
    return {t: [min(v, cap) if i else 0.0 for i, v in enumerate(row)] for t, row in final.items()}


def node_throughput_tables(cluster: HelixCluster, model: str, root: Path | None = None) -> list[list[float]]:
    """T[i][k]: tokens/s of compute node i holding k layers (index 0 is 0), authors' formula."""
    by_type = throughput_table(model, cluster.node_types, root=root)
    mp = load_machine_params(model, root)
    return [list(by_type[canonical_type(t, mp.gpus)]) for t in cluster.node_types]


def load_reference_throughput(name: str, root: Path | None = None) -> list[list[float]]:
    """The authors' own T tables from ``node_throughput/<name>.json`` (same shape as above)."""
    raw = json.loads(((root or data_root()) / "node_throughput" / f"{name}.json").read_text())
    table = raw["node_T_tokens_per_s"]
    out = []
    for i in range(len(table)):
        row = table[str(i)]
        kmax = max(int(k) for k in row)
        out.append([0.0] + [float(row[str(k)]) for k in range(1, kmax + 1)])
    return out
