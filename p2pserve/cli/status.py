"""``p2pserve status``: the swarm as the DHT shows it, once as text or JSON, or live on a web page.

    p2pserve status --initial-peers /ip4/.../p2p/Qm... --model M [--json]
    p2pserve status --config swarm.toml --web [--host 0.0.0.0] [--port 8787]

Peers (state, served and loading range, device, decode throughput at the served size, KV
load, claimed vs effective rate and why it is capped), measured links, coordinators and the
elected leader, the followed plan (epoch, targets, max-flow, upper bound) and its flows. The
data is :func:`p2pserve.dashboard.swarm_status.collect_status` (pure); the tables are
:func:`format_status` (pure), so both are tested without a network. ``--web`` serves the
dashboard (``docs/dashboard.md``) until Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from typing import Any, Optional

from p2pserve.cli.common import add_dht_arguments, dht_config_from_args, setup_logging
from p2pserve.config import DashboardConfig
from p2pserve.dashboard.snapshot import read_settled
from p2pserve.dashboard.swarm_status import collect_status, verification_status

__all__ = ["add_arguments", "collect_status", "format_status", "run", "verification_status"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``p2pserve status``."""
    add_dht_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--trusted-verifier", dest="trusted_verifiers", action="append", default=[],
                        metavar="KEY|PEER_ID", help="judge evidence as a coordinator trusting this verifier does")
    d = DashboardConfig()
    w = parser.add_argument_group("web dashboard (docs/dashboard.md)")
    w.add_argument("--web", action="store_true",
                   help="serve the live dashboard (page at /, JSON at /api/swarm) instead of printing once")
    w.add_argument("--host", default=d.host, help="address the dashboard listens on (default %(default)s; 0.0.0.0 "
                                                 "shows the swarm to anyone who can connect)")
    w.add_argument("--port", type=int, default=d.port, help="dashboard TCP port (0 = pick a free one; default %(default)s)")
    w.add_argument("--refresh", type=float, default=d.refresh_s, help="seconds between swarm reads (default %(default)s)")


def _short(pid: Optional[str]) -> str:
    if pid is None:
        return "-"
    return pid if len(pid) <= 12 or pid in ("source", "sink") else "…" + pid[-10:]


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [["-" if v is None else str(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def format_status(d: dict[str, Any]) -> str:
    """Human-readable tables of :func:`collect_status` output."""
    rng = lambda s: "-" if s is None else f"[{s[0]},{s[1]})"  # noqa: E731
    parts = [f"PEERS ({len(d['peers'])})"]
    parts.append(_table(
        ["peer", "state", "serving", "loading", "target", "device", "decode tok/s", "kv free", "queued", "age s"],
        [[_short(p["peer_id"]), p["state"], rng(p["serving"]), rng(p["loading"]), rng(p["target"]), p["device"],
          None if p["decode_tps"] is None else f"{p['decode_tps']:.1f}", p["kv_free_tokens"], p["queued_tokens"], p["age_s"]]
         for p in d["peers"]],
    ))
    capped = [p for p in d["peers"] if p.get("effective_tps", 0) < p.get("claimed_tps", 0) * (1 - 1e-9)]
    parts.append(f"\nCLAIMS (one-layer decode tok/s; {len(capped)} capped)")
    parts.append(_table(["peer", "claimed", "effective", "why"],
                        [[_short(p["peer_id"]), f"{p['claimed_tps']:.1f}", f"{p['effective_tps']:.1f}", p["claim"]]
                         for p in d["peers"] if "claim" in p]))
    parts.append(f"\nLINKS ({len(d['links'])})")
    parts.append(_table(["from", "to", "MB/s", "rtt ms"],
                        [[_short(l["src"]), _short(l["dst"]), f"{l['bandwidth_Bps'] / 1e6:.2f}", f"{l['rtt_s'] * 1e3:.2f}"] for l in d["links"]]))
    parts.append(f"\nCOORDINATORS (leader: {_short(d['leader'])})")
    parts.append(_table(["id", "priority", "leader"], [[_short(c["id"]), c["priority"], "*" if c["leader"] else ""] for c in d["coordinators"]]))
    p = d["plan"]
    if p is None:
        parts.append("\nPLAN: none published")
    else:
        parts.append(
            f"\nPLAN epoch {p['epoch']} by {_short(p['leader_id'])} ({p['reason']}, {p['age_s']} s ago): "
            f"max-flow {p['max_flow']:.1f} tok/s, upper bound {p['upper_bound']:.1f}, solve {p['solve_time_s'] * 1e3:.1f} ms"
            + (f", UNCOVERED layers {p['uncovered_layers']}" if p["uncovered_layers"] else "")
            + (f", {len(p['defaulted_links'])} links defaulted" if p["defaulted_links"] else "")
        )
        parts.append(_table(["from", "to", "tok/s"], [[_short(f["src"]), _short(f["dst"]), f"{f['tokens_per_s']:.1f}"] for f in p["flows"]]))
    if d.get("excluded") or d.get("accusations"):
        parts.append(f"\nEXCLUDED ({len(d['excluded'])}): peers verified evidence takes out of the plan")
        parts.append(_table(["peer", "in plan", "reason"],
                            [[e["peer_id"], "yes" if e["in_plan"] else "no", e["reason"]] for e in d["excluded"]]))
        parts.append(f"\nACCUSATIONS ({len(d['accusations'])})")
        parts.append(_table(["accused", "reporter", "kind", "layers", "position", "holds"],
                            [[_short(a["accused"]), _short(a["reporter"]), a["kind"], rng(a["layers"]), a["position"],
                              a["holds"]] for a in d["accusations"]]))
    return "\n".join(parts)


async def serve_web(swarm, dcfg, args: argparse.Namespace) -> int:
    """Serve the dashboard of ``swarm`` until SIGINT/SIGTERM."""
    from p2pserve.dashboard.server import serving
    from p2pserve.dashboard.watch import SwarmWatch

    config = DashboardConfig(host=args.host, port=args.port, refresh_s=args.refresh)
    watch = SwarmWatch(swarm, config, source="status", model=dcfg.model, swarm_id=dcfg.swarm_id,
                       num_layers=dcfg.num_layers, trusted_verifiers=tuple(args.trusted_verifiers))
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    async with serving(watch, config):
        await stop.wait()
    return 0


def run(args: argparse.Namespace) -> int:
    """Read the swarm once and print it, or serve the dashboard (``--web``)."""
    from p2pserve.errors import ConfigError

    setup_logging("WARNING" if args.log_level == "INFO" else args.log_level)
    from p2pserve.dht.swarm import Swarm

    dcfg, _ = dht_config_from_args(args)
    dcfg = dcfg.replace(client_mode=True, host_maddrs=("/ip4/127.0.0.1/tcp/0",) if not args.host_maddrs else dcfg.host_maddrs)
    swarm = Swarm.create(dcfg)
    try:
        if args.web:
            try:
                return asyncio.run(serve_web(swarm, dcfg, args))
            except ConfigError as e:
                print(f"error: {e}")
                return 2
        snap = asyncio.run(read_settled(swarm))
        d = collect_status(snap.peers, snap.links, snap.candidates, snap.plan, snap.taken_at, snap.reports,
                           snap.evidence, tuple(args.trusted_verifiers))
    finally:
        swarm.shutdown()
    if args.json:
        json.dump(d, sys.stdout, indent=2)
        print()
    else:
        print(format_status(d))
    return 0
