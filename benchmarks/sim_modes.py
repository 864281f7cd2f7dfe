"""Transport modes and speculation in the simulator: the ``modes`` section of ``benchmarks/sim.py``.

LLaMA-2-70B on the geo-distributed cluster (``distributed/cluster24_geo.ini``, Helix §5.1: three
regions, 1 ms inside, 50 ms between), the authors' cluster24 MILP placement mapped node for node by
GPU type (``helix-authors`` of ``sim_clusters.py``, depth ~16), IWRR with the KV mask. For a client
in each region, the four combinations of

* transport: ``push`` (peer to peer, last stage -> client) or ``client`` (every stage's output
  returns to the client, which sends it to the next stage);
* speculation: off, or k draft tokens a step at per-position acceptance a (a verify step runs
  k + 1 positions at every stage and yields (1 - a^(k+1)) / (1 - a) tokens on average);

are run offline (decode tokens/s, Helix's feeding rule) and online at a light load
(``LIGHT_RATE`` prompt + output tokens/s) where a request's own latency shows: ms per output
token (a step's mean latency over the tokens a step yields) and steps' p50 latency. Code: ``p2pserve/sim/transport.py``.
"""

from __future__ import annotations

import statistics

from p2pserve.helix import format as hf
from p2pserve.helix.root import data_root
from p2pserve.sim.run import SimConfig, simulate
from p2pserve.sim.scenario import build_scenario
from p2pserve.sim.transport import TransportConfig, expected_tokens

MODEL = "llama2-70b"
LIGHT_RATE = 20.0  # prompt + output tokens/s offered online: a few requests at a time


def geo_scenario():
    """The geo cluster under the authors' cluster24 MILP placement, mapped by GPU type."""
    from sim_clusters import (  # this directory is on sys.path when run
        CLUSTERS,
        LAYOUTS,
        _mapped,
    )

    d = data_root()
    geo = hf.load_cluster(d / "clusters" / CLUSTERS["geo"])
    c24 = hf.load_cluster(d / "clusters" / CLUSTERS["single"])
    return build_scenario(MODEL, [_mapped(d / LAYOUTS / "ilp" / "ilp_sol.ini", geo, c24)])


def _one(scenario, transport: TransportConfig, seeds, duration: float, online_s: float) -> dict:
    """Offline decode tok/s (mean over seeds) and light-load online per-token latency."""
    off = [simulate(scenario, SimConfig(mode="offline", duration=duration, seed=s, transport=transport))
           for s in seeds]
    on = simulate(scenario, SimConfig(mode="online", duration=online_s, seed=seeds[0], token_rate=LIGHT_RATE,
                                      transport=transport))
    steps = on.decode_latency_s.count
    per_step = on.decode_throughput_tokens_per_s * on.window_s / steps if steps else float("nan")
    return {
        "offline_decode_tokens_per_s": statistics.fmean(r.decode_throughput_tokens_per_s for r in off),
        "offline_per_seed": [r.decode_throughput_tokens_per_s for r in off],
        "online_step_latency_p50_s": on.decode_latency_s.p50,
        "online_tokens_per_step": per_step,
        "online_ms_per_token": 1e3 * on.decode_latency_s.mean / per_step if steps else float("nan"),
        "online_prompt_latency_p50_s": on.prompt_latency_s.p50,
        "avg_route_depth": off[0].avg_route_depth,
    }


def modes_section(seeds, duration: float, online_s: float, spec_k: int = 4, acceptance: float = 0.6,
                  regions=(0, 1, 2)) -> dict:
    """The four combinations for a client in each of ``regions``; ratios against push without
    speculation in the same region."""
    print(f"\n== 9. Transport modes x speculation (k={spec_k}, a={acceptance}): 70B on geo, helix-authors, IWRR ==")
    sc = geo_scenario()
    combos = [(mode, k) for mode in ("push", "client") for k in (0, spec_k)]
    out = {"spec_k": spec_k, "acceptance": acceptance, "expected_tokens_per_step": expected_tokens(acceptance, spec_k),
           "light_rate_tokens_per_s": LIGHT_RATE, "regions": {}}
    print(f"{'region':>6} {'mode':<7} {'spec':>4} {'offline tok/s':>13} {'x push':>7} {'online ms/tok':>13} "
          f"{'x push':>7} {'tok/step':>8}")
    for region in regions:
        rows = {}
        for mode, k in combos:
            t = TransportConfig(mode=mode, client_region=region, spec_k=k, acceptance=acceptance if k else 0.0)
            rows[f"{mode}{'+spec' if k else ''}"] = _one(sc, t, seeds, duration, online_s)
        base = rows["push"]
        for name, r in rows.items():
            r["offline_vs_push"] = r["offline_decode_tokens_per_s"] / base["offline_decode_tokens_per_s"]
            r["online_ms_per_token_vs_push"] = r["online_ms_per_token"] / base["online_ms_per_token"]
            mode, _, spec = name.partition("+")
            print(f"{region:>6} {mode:<7} {'on' if spec else 'off':>4} {r['offline_decode_tokens_per_s']:13.1f} "
                  f"{r['offline_vs_push']:7.2f} {r['online_ms_per_token']:13.1f} "
                  f"{r['online_ms_per_token_vs_push']:7.2f} {r['online_tokens_per_step']:8.2f}", flush=True)
        out["regions"][str(region)] = rows
    return out
