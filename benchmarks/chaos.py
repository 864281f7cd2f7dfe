"""Chaos benchmark: the CI chaos test's driver (``tests/chaos/driver.py``) run for longer.

A bootstrap node, two coordinators and five plan-driven peers (real processes, one torch thread
each) on a seeded tiny fp32 Llama of 12 layers; eight chat clients on two client nodes chat
continuously (greedy, 24 new tokens, every reply checked against single-process ``generate``);
a seeded fault driver SIGKILLs and restarts peers, freezes them (SIGSTOP, then SIGCONT) and kills
and restarts the elected coordinator, never leaving the healthy peers unable to cover the model
and never more than two peer slots unhealthy; a hostile participant attacks live peers.

Figures (all from this run): requests completed, lost (raised to the caller despite the client's
own failover; nothing retries at the application level) and token-identical; faults by kind;
attacks by kind with what the peers answered; per peer process RSS and open fds (first, max,
last; the process alone and with its DHT child and libp2p daemon); peers whose compute thread
died or was restarted. Ratios: identical / completed, lost / started, and each peer's max RSS
over its first sample.

Usage: python benchmarks/chaos.py --minutes 10 [--seed 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.chaos.driver import ChaosConfig, run_chaos  # noqa: E402


def ratios(report: dict) -> dict:
    """The run's ratios (see the module docstring)."""
    req = report["requests"]
    rss = {name: p["rss_main_mib"]["max"] / p["rss_main_mib"]["first"]
           for name, p in report["peer_processes"].items() if p.get("samples")}
    return {
        "identical_over_completed": req["identical"] / req["completed"] if req["completed"] else 0.0,
        "lost_over_started": req["lost"] / req["started"] if req["started"] else 0.0,
        "requests_with_failover_over_completed": req["requests_with_failover"] / req["completed"] if req["completed"] else 0.0,
        "peer_rss_max_over_first": rss,
    }


def headline(report: dict) -> str:
    """A few lines a person reads first."""
    req, faults, att, comp = report["requests"], report["faults"], report["attacks"], report["compute"]
    lines = [
        f"chaos {report['chaos_s']:.0f} s: {req['completed']} requests completed, {req['lost']} lost, "
        f"{req['identical_pct']:.2f} % token-identical, {req['requests_with_failover']} re-routed",
        f"faults {faults['total']}: {faults['by_kind']} (skipped: {sum(faults['skipped'].values())})",
        f"attacks {att['total']}: {att['sent']}",
        f"dead compute threads: {comp['dead_threads']}; stats polls {comp['stats_polls']} "
        f"({comp['unanswered_polls']} unanswered)",
    ]
    for name, p in report["peer_processes"].items():
        if p.get("samples"):
            lines.append(f"  {name:9s} RSS {p['rss_main_mib']['first']:.0f} -> max {p['rss_main_mib']['max']:.0f} -> "
                         f"{p['rss_main_mib']['last']:.0f} MiB (with children max {p['rss_total_mib']['max']:.0f}); "
                         f"fds {p['fds_main']['first']} -> max {p['fds_main']['max']} -> {p['fds_main']['last']}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the chaos phase")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-faults", type=int, default=20)
    ap.add_argument("--workdir", default=None, help="model, logs and report (default: a new temp dir)")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "chaos.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    torch.set_num_threads(1)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="p2pserve-chaos-"))
    seconds = args.minutes * 60
    t0 = time.monotonic()
    report = asyncio.run(run_chaos(ChaosConfig(workdir=workdir, min_chaos_s=seconds, max_chaos_s=seconds * 1.5 + 60,
                                               min_faults=args.min_faults, seed=args.seed)))
    report["wall_s"] = round(time.monotonic() - t0, 1)
    report["ratios"] = ratios(report)
    print(headline(report))
    print(json.dumps(report["ratios"], indent=2))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"wrote {out} (logs in {report['logs']})")
    return 0 if report["requests"]["lost"] == 0 and report["requests"]["identical"] == report["requests"]["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
