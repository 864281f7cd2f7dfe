"""`p2pserve demo`: a whole local swarm answering a chat prompt, then a clean shutdown.

It starts, as subprocesses on loopback: a bootstrap DHT node, a coordinator and N plan-driven
peers (each allowed only part of the model, so the plan must chain them). It waits for the
elected coordinator's plan to cover every layer with loaded ranges, prints the plan, answers the
prompt through the swarm with the Python client (per-request IWRR route, failover on), prints the
route used, and stops everything. Every child runs in its own process group and is killed on
exit, on errors and on Ctrl-C, so an interrupted demo leaves nothing running.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from pathlib import Path

from p2pserve.launch import Children
from p2pserve.types import SINK, SOURCE

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."
TIMING = dict(peer_refresh=1.0, candidate_refresh=1.0, plan_refresh=3.0, link_refresh=10.0, max_clock_skew=2.0)
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
SWARM_ID = "p2pserve-demo"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the demo's flags."""
    from p2pserve.cli.common import add_revision_argument

    p.add_argument("--model", default="default",
                   help="checkpoint directory, a hub id ORG/NAME (docs/hub.md), or 'default' (embedded SmolLM2-135M-Instruct)")
    add_revision_argument(p)
    p.add_argument("--peers", type=int, default=3, help="number of peer processes")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message to answer")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--threads", type=int, default=1, help="torch threads per peer")
    p.add_argument("--timeout", type=float, default=300.0, help="give up if the swarm is not ready by then (s)")


def _wait(check, children: Children, what: str, timeout: float):
    """Poll ``check`` until it returns something truthy, printing a dot every few seconds."""
    start = last = time.monotonic()
    while time.monotonic() - start < timeout:
        children.check()
        value = check()
        if value:
            print(f" ready ({time.monotonic() - start:.0f} s)", flush=True)
            return value
        if time.monotonic() - last > 3:
            print(".", end="", flush=True)
            last = time.monotonic()
        time.sleep(0.5)
    raise TimeoutError(f"{what} not ready after {timeout:.0f} s (logs in {children.logdir})")


def _print_plan(plan, short) -> None:
    p = plan.plan
    print(f"plan epoch {p.epoch} by {short(p.leader_id)}: max-flow {p.max_flow:.0f} tokens/s "
          f"(upper bound {p.upper_bound:.0f}), solved in {p.solve_time:.2f} s")
    for pid, (a, b) in sorted(p.spans.items(), key=lambda kv: kv[1]):
        print(f"  peer {short(pid)} serves layers [{a}, {b})")
    for f in p.flows:
        if f.rate > 0:
            print(f"  flow {short(f.src)} -> {short(f.dst)}: {f.rate:.0f} tokens/s")


async def _chat(model, boot: list[str], swarm_model: str, args) -> None:
    from p2pserve.client.api import AsyncClient
    from p2pserve.config import DHTConfig

    cfg = DHTConfig(model=swarm_model, swarm_id=SWARM_ID, initial_peers=tuple(boot), host_maddrs=(LOOPBACK,),
                    client_mode=True, **TIMING)
    client = AsyncClient(model=model.path, dht_config=cfg, model_info=model)
    await client.start()
    try:
        print(f"\nuser: {args.prompt}\nassistant: ", end="", flush=True)
        stream = client.chat_stream([{"role": "user", "content": args.prompt}], max_new_tokens=args.max_new_tokens,
                                    temperature=args.temperature)
        async for piece in stream:
            print(piece, end="", flush=True)
        reply = stream.reply
        print(f"\n\nroute: client -> {reply.route_text()} -> client")
        print(f"[{len(reply.tokens)} tokens in {reply.elapsed_s:.1f} s, {reply.tokens_per_s:.1f} tokens/s, "
              f"through {len(reply.route)} peer processes]")
    finally:
        await client.close()


def _start_bootstrap(children: Children) -> list[str]:
    """Start the bootstrap node; its multiaddrs once it listens."""
    print("[2/5] starting the bootstrap node...", end="", flush=True)
    maddrs_file = children.logdir / "bootstrap.maddrs"
    children.start("bootstrap", "bootstrap", "--host-maddrs", LOOPBACK, "--maddrs-file", str(maddrs_file),
                   "--log-level", "WARNING")
    _wait(maddrs_file.exists, children, "bootstrap node", 60)
    return maddrs_file.read_text().split()


def _start_swarm(children: Children, model, boot: list[str], args) -> int:
    """Write the swarm file, start a coordinator and the peers; returns the number of peers."""
    from p2pserve.cli.common import write_local_swarm_file

    spec = model.spec
    n = max(1, args.peers)
    # Each peer may hold a bit more than its share, so the plan must chain every peer.
    max_layers = min(spec.num_layers, math.ceil(spec.num_layers / n) + (1 if n > 1 else 0))
    cfg_path = children.logdir / "swarm.json"
    write_local_swarm_file(cfg_path, spec, boot, SWARM_ID, LOOPBACK, TIMING, solve_time_limit=2.0)
    print(f"[3/5] starting a coordinator and {n} peers (at most {max_layers} of {spec.num_layers} layers each);"
          f" they profile themselves and wait for the plan", end="", flush=True)
    children.start("coordinator", "coordinator", "--config", str(cfg_path), "--log-level", "WARNING")
    for i in range(n):
        children.start(f"peer{i + 1}", "peer", "--model", model.path, "--config", str(cfg_path),
                       "--max-layers", str(max_layers), "--num-threads", str(args.threads),
                       "--log-level", "WARNING", threads=args.threads)
    return n


def _await_plan(children: Children, swarm_model: str, boot: list[str], n: int, timeout: float):
    """Watch the swarm until the plan's loaded ranges cover every layer; returns that plan."""
    from p2pserve.config import DHTConfig
    from p2pserve.dht.swarm import Swarm

    observer = Swarm.create(DHTConfig(model=swarm_model, swarm_id=SWARM_ID, initial_peers=tuple(boot),
                                      host_maddrs=(LOOPBACK,), client_mode=True, **TIMING))
    try:
        def ready_plan():
            plan = asyncio.run(observer.get_plan())
            if plan is None:
                return None
            cover = plan.plan.coverage()
            return plan if cover and min(cover) > 0 and len(plan.plan.spans) >= min(n, 2) else None

        print("\n[4/5] waiting for a plan whose ranges are loaded and cover every layer", end="", flush=True)
        return _wait(ready_plan, children, "the plan", timeout)
    finally:
        observer.shutdown()


def run(args: argparse.Namespace) -> int:
    """Entry point of `p2pserve demo`."""
    from p2pserve.client.model_info import LocalModelInfo
    from p2pserve.errors import P2PServeError
    from p2pserve.model.identity import swarm_model_name

    children = Children(Path(tempfile.mkdtemp(prefix="p2pserve-demo-")))
    try:
        print(f"logs: {children.logdir}", flush=True)
        print("[1/5] preparing the model (the first run converts the embedded SmolLM2 GGUF, ~30 s)...", flush=True)
        model = LocalModelInfo.load(args.model)
        name = swarm_model_name(args.model, spec=model.spec)  # what every member derives from --model
        boot = _start_bootstrap(children)
        n = _start_swarm(children, model, boot, args)
        plan = _await_plan(children, name, boot, n, args.timeout)
        _print_plan(plan, lambda pid: pid if pid in (SOURCE, SINK) else pid[-6:])
        print("[5/5] chatting through the swarm", flush=True)
        asyncio.run(_chat(model, boot, name, args))
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted; stopping the swarm", file=sys.stderr)
        return 130
    except (P2PServeError, RuntimeError, TimeoutError) as e:
        print(f"\np2pserve demo: error: {e}", file=sys.stderr)
        return 2
    finally:
        children.stop_all()
        print("all demo processes stopped", flush=True)
