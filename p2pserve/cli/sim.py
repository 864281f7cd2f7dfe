"""``p2pserve sim``: simulate a Helix cluster file under a placement, a scheduler, a workload.

Examples::

    p2pserve sim --cluster single_cluster/cluster24.ini --model llama2-70b \\
        --placement single_cluster/llama70b/ilp/ilp_sol.ini --scheduler iwrr --mode offline --duration 600 --json

A relative ``--cluster`` / ``--placement`` that does not exist as given is looked up under the
Helix data root's ``clusters/`` / ``layouts/`` (``--data``, else ``$P2PSERVE_HELIX_DATA``, else the
copy shipped with the package; see :mod:`p2pserve.helix.root`); traces come from the same root.
``--cluster`` and ``--placement`` may be repeated in pairs to join several clusters under one
coordinator without links between them (the separate-pipelines baseline). In online mode the
offered load is ``--rate`` prompt+output tokens/s; without it, a short offline run of the same
setup measures the peak and the rate is set to ``ONLINE_LOAD_FACTOR`` of it (see ``docs/sim.md``).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from p2pserve.cli.machine_output import print_json, stdout_to_stderr
from p2pserve.errors import ConfigError
from p2pserve.helix.root import data_root, resolve_file

#: Online load as a share of the simulated offline peak (prompt+output tokens/s). The paper
#: offers 75% of peak; the authors' rates (700 for Helix, 350 for Swarm on cluster24, 70B) are
#: 75% of their prototype's offline peak, which ran at ~0.886 of their simulator's.
ONLINE_LOAD_FACTOR = 0.75 * 0.886


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``sim``'s flags."""
    from p2pserve.sim.schedulers import SCHEDULERS

    parser.add_argument("--cluster", action="append", required=True, metavar="FILE.ini",
                        help="Helix cluster file or a name under the data root's clusters/ "
                             "(repeat, paired with --placement, to join clusters)")
    parser.add_argument("--data", default=None, metavar="DIR",
                        help="Helix data root (default: $P2PSERVE_HELIX_DATA, else the packaged copy)")
    parser.add_argument("--model", required=True, choices=["llama2-70b", "llama1-30b"])
    parser.add_argument("--placement", action="append", required=True, metavar="planner|FILE",
                        help="'planner' (our planner) or a Helix *_sol.ini (or a name under the data "
                             "root's layouts/); one per --cluster")
    parser.add_argument("--scheduler", default="iwrr", choices=list(SCHEDULERS))
    parser.add_argument("--mode", default="offline", choices=["offline", "online"])
    parser.add_argument("--duration", type=float, default=None,
                        help="measurement window in simulated seconds (default 600 offline, 1800 online)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="simulated seconds before the window (default 60 offline, 30 online)")
    parser.add_argument("--rate", type=float, default=None,
                        help="online offered load, prompt+output tokens/s (default: calibrated)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--throttle", nargs="?", const="on", default="off", choices=["off", "on", "prefill", "chunked"],
                        help="gLLM token throttling instead of the fixed batch caps (prefill: prompt budget only; "
                             "chunked: throttling with chunked prefill, as p2pserve peers batch)")
    parser.add_argument("--kv-mask", choices=["auto", "on", "off"], default="auto",
                        help="route with Helix's KV estimate mask (auto: only for iwrr)")
    parser.add_argument("--kv-model", choices=["reserve", "vllm"], default="reserve",
                        help="node KV: reserve the whole footprint at admission, or vLLM-like "
                             "allocation with recompute preemption")
    parser.add_argument("--bandwidth-convention", choices=["helix", "bits"], default="helix",
                        help="helix: file number read as bytes/s (the authors'); bits: divide by 8")
    parser.add_argument("--planner-time", type=float, default=20.0,
                        help="seconds our planner may search when --placement planner (an outer limit "
                             "when --planner-work is given)")
    parser.add_argument("--planner-work", type=int, default=None, metavar="EVALS",
                        help="our planner's budget in evaluations: same seed and inputs, same placement "
                             "on any machine")
    parser.add_argument("--no-layout-kv", action="store_true",
                        help="ignore a layout's simulator_cluster.ini KV capacities")
    parser.add_argument("--transport", choices=["push", "client"], default="push",
                        help="push: peer to peer, last stage to the client; client: every stage's output "
                             "returns to the client, which sends it to the next stage (see docs/sim.md)")
    parser.add_argument("--client-region", type=int, default=None, metavar="R",
                        help="put the client in region R (nodes joined by links of <= 5 ms one-way; "
                             "default: the cluster file's source/sink links)")
    parser.add_argument("--spec-k", type=int, default=0, metavar="K",
                        help="speculative decoding: K draft tokens verified per decode step (0: off)")
    parser.add_argument("--spec-acceptance", type=float, default=0.6, metavar="A",
                        help="with --spec-k: each draft position accepted with probability A given the earlier ones")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def build_parts(args: argparse.Namespace, root: Path):
    """Scenario parts from the paired ``--cluster`` / ``--placement`` flags."""
    from p2pserve.sim.scenario import helix_part, planner_part

    if len(args.cluster) != len(args.placement):
        raise ConfigError("give one --placement per --cluster")
    parts = []
    for name, placement in zip(args.cluster, args.placement):
        cluster = resolve_file(name, "clusters", root)
        if placement == "planner":
            parts.append(planner_part(cluster, args.model, time_limit_s=args.planner_time, seed=args.seed, root=root,
                                       work=args.planner_work))
        else:
            layout = resolve_file(placement, "layouts", root)
            parts.append(helix_part(cluster, layout, kv_from_layout=not args.no_layout_kv))
    return parts


def run(args: argparse.Namespace) -> int:
    """Run the simulation and print a summary (or JSON: one document on stdout, all else on stderr)."""
    with stdout_to_stderr(args.json) as out:
        return _run(args, out)


def _run(args: argparse.Namespace, out) -> int:
    from dataclasses import replace

    from p2pserve.placement.topology import BandwidthConvention
    from p2pserve.sim.run import SimConfig, simulate
    from p2pserve.sim.scenario import build_scenario
    from p2pserve.sim.transport import TransportConfig

    conv = BandwidthConvention.HELIX if args.bandwidth_convention == "helix" else BandwidthConvention.BITS_PER_S
    try:
        transport = TransportConfig(mode=args.transport, client_region=args.client_region, spec_k=args.spec_k,
                                    acceptance=args.spec_acceptance if args.spec_k else 0.0)
        root = data_root(args.data)
        scenario = build_scenario(args.model, build_parts(args, root), convention=conv, root=root)
        kv_mask = None if args.kv_mask == "auto" else args.kv_mask == "on"
        duration = args.duration if args.duration is not None else (600.0 if args.mode == "offline" else 1800.0)
        cfg = SimConfig(scheduler=args.scheduler, mode=args.mode, duration=duration, warmup=args.warmup,
                        seed=args.seed, token_rate=args.rate, throttle=args.throttle, kv_mask=kv_mask,
                        kv_model=args.kv_model, transport=transport)
        calibration = None
        if args.mode == "online" and args.rate is None:  # offered load: a share of this setup's own offline peak
            calibration = simulate(scenario, replace(cfg, mode="offline", duration=300.0, warmup=SimConfig().warmup))
            cfg = replace(cfg, token_rate=ONLINE_LOAD_FACTOR * offline_token_rate(
                calibration.decode_throughput_tokens_per_s, root))
        result = simulate(scenario, cfg)
    except ConfigError as exc:  # also a client region the cluster lacks, a link client mode needs
        print(f"p2pserve sim: {exc}", file=sys.stderr)
        return 2
    if calibration is not None:
        result.extra["rate_calibrated_from_offline_decode_tokens_per_s"] = calibration.decode_throughput_tokens_per_s
    if args.json:
        print_json(_clean(result.to_dict()), out)
    else:
        print(format_result(result))
    return 0


def offline_token_rate(decode_tokens_per_s: float, root: Path | None = None) -> float:
    """Prompt+output tokens/s implied by a decode rate, at the Azure trace's mean lengths."""
    from p2pserve.sim.workload import load_lengths

    inputs, outputs = load_lengths(root=root)
    return decode_tokens_per_s * (inputs.mean() + outputs.mean()) / outputs.mean()


def format_result(r) -> str:
    """A short human-readable summary."""
    p, d = r.prompt_latency_s, r.decode_latency_s
    return "\n".join([
        f"decode throughput  {r.decode_throughput_tokens_per_s:8.1f} tokens/s over {r.window_s:.0f} s",
        f"prompt latency     mean {p.mean:7.2f}  p50 {p.p50:7.2f}  p95 {p.p95:7.2f} s  (n={p.count})",
        f"decode latency     mean {d.mean:7.3f}  p50 {d.p50:7.3f}  p95 {d.p95:7.3f} s  (n={d.count})",
        f"queries            {r.queries_submitted} submitted, {r.queries_finished_in_window} finished "
        f"in window, {r.queries_waiting_at_end} waiting at end; mean route depth {r.avg_route_depth:.1f}",
        f"simulated {r.simulated_s:.0f} s in {r.wall_s:.1f} s wall ({r.events} events)",
    ])


def _clean(obj):
    """JSON has no NaN: replace it with None."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj
