"""Trust benchmark: what bound identities, the encrypted direct path, checked claims
and verified outputs cost, and what they buy. One JSON with every figure the issue names.

It runs the three measurements that live in their own benchmarks, each against a baseline
timed the same way in the same run, and gathers their results:

* ``benchmarks/direct_tls.py``: the encryption cost per hop on loopback (plaintext TCP vs TLS
  1.3 on the direct path), small frames and 1 MiB frames;
* ``benchmarks/sybil.py``: the share of the plan's flow 1 inflated peer, 10 and 100 Sybils
  capture, with the claim policy off ("before") and on ("after");
* ``benchmarks/verification.py``: ``verification_overhead`` (aggregate tokens/s with
  verification on at the default share against off, over the whole run and paired within each
  cycle of phases, as CPU seconds per token, and with ``verify_hold`` and with every request
  checked against off), ``requests_to_exclusion`` of a peer that
  corrupts 10% of its steps, ``false_exclusions`` over verified honest steps in fp32 and bf16,
  and the signing cost per step;
* ``benchmarks/framing.py``: 3, 10 and 30 Sybil reporters with no colluding peer accusing honest
  peers (honest exclusions, the honest peers' flow against before), and a corrupting peer
  convicted by the coordinator's own re-execution (requests until the plan drops it).

Usage::

    python benchmarks/trust.py [--quick] [--only tls,sybil,verification] [--json out.json]

``--quick`` passes each part its own quick setting (fewer repetitions and steps; for a smoke
run, not for the figures of record).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

#: part name -> the benchmark module whose ``measure(...) -> dict`` it runs
PARTS = {"tls": "direct_tls", "sybil": "sybil", "verification": "verification", "framing": "framing"}

#: keyword arguments of each part's ``measure`` for a full run and for ``--quick``
SETTINGS = {
    "tls": ({}, {"quick": True}),
    "sybil": ({"time_limit": 2.0}, {"time_limit": 0.5, "counts": (1, 10)}),
    "verification": ({}, {"honest_steps": 1000, "trials": 1, "rounds": 10}),
    "framing": ({"culprit": True}, {"reporters": (3,)}),
}


def run_part(name: str, quick: bool) -> dict:
    """Import one part's benchmark and run its ``measure``; its figures plus its wall time."""
    module = importlib.import_module(PARTS[name])
    t0 = time.perf_counter()
    figures = module.measure(**SETTINGS[name][1 if quick else 0])
    figures["wall_s"] = round(time.perf_counter() - t0, 1)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions: a smoke run")
    ap.add_argument("--only", default=",".join(PARTS), help="comma-separated parts: " + ", ".join(PARTS))
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "trust.json"))
    args = ap.parse_args()
    wanted = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(wanted) - set(PARTS))
    if unknown:
        ap.error(f"unknown parts {unknown}; choose from {sorted(PARTS)}")
    out: dict = {"quick": args.quick}
    for name in wanted:
        print(f"== {name} ({PARTS[name]}.py)", flush=True)
        out[name] = run_part(name, args.quick)
        print(json.dumps(out[name], indent=1, default=str), flush=True)
    summary = summarize(out)
    out["summary"] = summary
    print("== summary")
    for k, v in summary.items():
        print(f"  {k}: {v}")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {path}")


def summarize(out: dict) -> dict:
    """The issue's named figures, lifted from the parts' results (those that ran)."""
    summary: dict = {}
    verification = out.get("verification", {})
    for key in ("verification_overhead", "requests_to_exclusion", "false_exclusions", "sign_us_per_step"):
        if key in verification:
            summary[key] = verification[key]
    overhead = verification.get("verification_overhead", {})
    if "paired" in overhead:  # load drift between cycles cancelled
        summary["verification_overhead_paired_median"] = overhead["paired"]["median"]
    if "cpu_ratio" in overhead:  # CPU seconds per token off over on: the checks' work, load barely moves it
        summary["verification_overhead_cpu_ratio"] = overhead["cpu_ratio"]
    if "sybil_flow_share" in out.get("sybil", {}):
        summary["sybil_flow_share"] = out["sybil"]["sybil_flow_share"]
    if "reporters" in out.get("framing", {}):
        summary["framing"] = out["framing"]["reporters"]
        if "culprit" in out["framing"]:
            summary["culprit"] = out["framing"]["culprit"]
    if "encryption_cost_per_hop" in out.get("tls", {}):
        summary["encryption_cost_per_hop"] = out["tls"]["encryption_cost_per_hop"]
    return summary


if __name__ == "__main__":
    main()
