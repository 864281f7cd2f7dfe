"""Fuzzing run: every decoder property of ``tests/fuzz`` with N examples each.

    python benchmarks/fuzz.py --examples 2000                  # what CI runs, as a report
    python benchmarks/fuzz.py --examples 100000 --json out.json # the long run
    python benchmarks/fuzz.py --examples 200 --stateful 30      # and the real-peer state machine

Each property runs in its own child process (one at a time unless ``--jobs``), with
``P2PSERVE_FUZZ_EXAMPLES=N``, a per-example watchdog (``--example-timeout-s``: an example that runs
longer fails as stuck) and a wall-clock limit on the child (a child past it counts as a stuck
worker). ``--random`` draws fresh examples instead of the derandomized CI sequence. Prints, per
decoder, the examples run, failures and wall time; writes JSON (``--json``, default
``benchmarks/results/fuzz.json``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODULES = ["tests.fuzz.test_wire", "tests.fuzz.test_frames", "tests.fuzz.test_direct", "tests.fuzz.test_records",
           "tests.fuzz.test_dht_readers", "tests.fuzz.test_prober"]
MARK = "FUZZ_RESULT "


def properties() -> list[tuple[str, str, str]]:
    """(module, function, decoder name) of every counted property."""
    found = []
    for name in MODULES:
        module = importlib.import_module(name)
        for attr, fn in vars(module).items():
            inner = getattr(getattr(fn, "hypothesis", None), "inner_test", None)
            if attr.startswith("test_") and hasattr(inner, "decoder"):
                found.append((name, attr, inner.decoder))
    return found


def child(module: str, function: str) -> None:
    """Run one property here; print its result as one JSON line."""
    from tests.fuzz import RUNS

    fn = getattr(importlib.import_module(module), function)
    name = fn.hypothesis.inner_test.decoder
    t0, failure = time.perf_counter(), None
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - any failure is the result we report
        failure = f"{type(e).__name__}: {e}"[:4000]
    print(MARK + json.dumps({"decoder": name, "examples": RUNS[name], "failure": failure,
                             "wall_s": round(time.perf_counter() - t0, 1)}), flush=True)


def run_child(args, module: str, function: str, decoder: str, env: dict) -> dict:
    cmd = [sys.executable, __file__, "--child", f"{module}:{function}"]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.worker_timeout_s)
    except subprocess.TimeoutExpired:
        return {"decoder": decoder, "examples": None, "failure": "worker timed out", "stuck": True,
                "wall_s": round(time.perf_counter() - t0, 1)}
    lines = [line for line in out.stdout.splitlines() if line.startswith(MARK)]
    if not lines:
        return {"decoder": decoder, "examples": None, "stuck": False, "wall_s": round(time.perf_counter() - t0, 1),
                "failure": f"worker exited {out.returncode}: {(out.stdout + out.stderr)[-2000:]}"}
    return {**json.loads(lines[-1][len(MARK):]), "stuck": False}


def run_stateful(args, env: dict) -> dict:
    """The real-peer state machine through pytest, with ``--stateful`` examples."""
    report = Path(tempfile.mkdtemp(prefix="p2pserve-fuzz-")) / "stateful.json"
    env = dict(env, P2PSERVE_FUZZ_STATEFUL_EXAMPLES=str(args.stateful), P2PSERVE_FUZZ_STATEFUL_REPORT=str(report))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/fuzz/test_stateful_peer.py"]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.worker_timeout_s)
    except subprocess.TimeoutExpired:
        return {"decoder": "stateful peer", "examples": None, "failure": "worker timed out", "stuck": True,
                "wall_s": round(time.perf_counter() - t0, 1)}
    seen = json.loads(report.read_text()) if report.exists() else {}
    return {"decoder": "stateful peer", "examples": seen.get("examples"), "steps": seen.get("steps"),
            "seen": seen.get("seen"), "stuck": False, "wall_s": round(time.perf_counter() - t0, 1),
            "failure": None if out.returncode == 0 else out.stdout[-4000:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=2000, help="examples per decoder property")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "fuzz.json"))
    ap.add_argument("--stateful", type=int, default=0, metavar="N", help="also run the real-peer machine, N examples")
    ap.add_argument("--only", default="", help="run only decoders whose name contains one of these (comma-separated)")
    ap.add_argument("--random", action="store_true", help="fresh random examples (CI's sequence is derandomized)")
    ap.add_argument("--jobs", type=int, default=1, help="properties run at once (the test machine has 2 cores)")
    ap.add_argument("--example-timeout-s", type=float, default=30.0, help="an example past this is stuck")
    ap.add_argument("--worker-timeout-s", type=float, default=None, help="a child past this is a stuck worker")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child.split(":"))
        return 0
    args.worker_timeout_s = args.worker_timeout_s or 600 + 0.25 * args.examples
    env = dict(os.environ, P2PSERVE_FUZZ_EXAMPLES=str(args.examples),
               P2PSERVE_FUZZ_EXAMPLE_TIMEOUT=str(args.example_timeout_s), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if args.random:
        env["P2PSERVE_FUZZ_RANDOM"] = "1"
    todo = [p for p in properties() if any(part in p[2] for part in args.only.split(","))]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(lambda p: _report(run_child(args, *p, env)), todo))
    if args.stateful:
        results.append(_report(run_stateful(args, env)))
    summary = {"examples_per_decoder": args.examples, "random": args.random, "decoders": len(todo),
               "failures": sum(r["failure"] is not None for r in results),
               "stuck_workers": sum(r["stuck"] for r in results), "wall_s": round(time.perf_counter() - t0, 1),
               "results": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(summary, indent=2))
    print(f"\n{len(results)} runs, {summary['failures']} failures, {summary['stuck_workers']} stuck workers, "
          f"{summary['wall_s']} s; JSON in {args.json}")
    return 1 if summary["failures"] or summary["stuck_workers"] else 0


def _report(r: dict) -> dict:
    status = "STUCK" if r["stuck"] else "FAIL" if r["failure"] else "ok"
    print(f"{r['decoder']:36s} {str(r['examples']):>8s} examples  {r['wall_s']:8.1f} s  {status}", flush=True)
    if r["failure"]:
        print("    " + r["failure"][:1500].replace("\n", "\n    "), flush=True)
    return r


if __name__ == "__main__":
    sys.exit(main())
