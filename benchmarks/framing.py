"""Framing benchmark: Sybil reporters with no colluding peer accuse honest peers; a real culprit is
still convicted by the coordinator's own re-execution.

Real processes on loopback: a bootstrap node, a coordinator with the default policy (no trusted
verifier), three honest peers of the tiny 8-layer Llama serving the whole model, and (with
``--culprit``) one peer corrupting 10% of its steps (``tests/dishonest.py``).

* ``framing``: for 3, 10 and 30 reporters, the attacker (``p2pserve.testing.framing``) files
  cases from the honest peers' own signed replies (sampled tokens with other seeds, honest
  rounding) under that many fresh DHT keys, waits ``--settle`` seconds of coordinator rounds,
  and reads the plan: honest peers excluded (out of the plan, or named in an "excluding peer"
  line of the coordinator's log) and the honest peers' share of the plan's flow against before.
* ``culprit``: a client whose key nobody trusts sends 16-token greedy requests with
  ``verify_share`` 0.02 until the plan drops the corrupting peer (at most 200): the requests
  until it is banned by the client and until the coordinator's re-execution drops it from the
  plan, and whether an honest peer was excluded meanwhile.

Usage::

    python benchmarks/framing.py [--reporters 3,10,30] [--culprit] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TIMING = dict(peer_refresh=0.5, candidate_refresh=0.5, plan_refresh=1.0, link_refresh=5.0, max_clock_skew=2.0)
DEADLINE = 180.0


def _tiny_model(workdir: Path) -> str:
    from p2pserve.model.tiny import build_tiny_model

    path = workdir / "tiny-llama"
    build_tiny_model("llama", str(path))
    return str(path)


async def _plan_flows(routes) -> dict[str, float]:
    await routes.refresh(force=True)
    plan = routes.plan
    if plan is None:
        return {}
    out: dict[str, float] = {}
    for f in plan.flows:
        if f.src in plan.spans:
            out[f.src] = out.get(f.src, 0.0) + f.rate
    return out


def measure(reporters=(3, 10, 30), culprit: bool = False, settle_s: float = 8.0, max_requests: int = 200) -> dict:
    """Run the swarm, the framing rounds and (``culprit``) the culprit's conviction; the figures."""
    from p2pserve.cli.common import write_local_swarm_file
    from p2pserve.client.api import AsyncClient
    from p2pserve.client.model_info import LocalModelInfo
    from p2pserve.client.node import client_transport
    from p2pserve.config import ClientConfig, DHTConfig
    from p2pserve.launch import Children, PeerProcess
    from p2pserve.testing.framing import FramingAttacker, publish_from_fresh_keys

    work = Path(tempfile.mkdtemp(prefix="p2pserve-framing-"))
    children = Children(work)
    path = _tiny_model(work)
    model = LocalModelInfo.load(path)
    peers, bad = [], None
    out: dict = {"reporters": {}}
    try:
        children.start("boot", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--maddrs-file", str(work / "boot"))
        end = time.monotonic() + DEADLINE
        while not (work / "boot").exists() and time.monotonic() < end:
            time.sleep(0.2)
        boot = (work / "boot").read_text().split()
        cfg = work / "swarm.json"
        write_local_swarm_file(cfg, model.spec, boot, "framing", "/ip4/127.0.0.1/tcp/0", TIMING, 0.5)
        # no compute probes: the plan then rests on the peers' announced claims alone, so the honest
        # flow before and after an attack compares like with like (probes on a loaded machine move
        # it by tens of percent); retrials run on a node of the coordinator's own all the same
        children.start("coord", "coordinator", "--config", str(cfg), "--compute-probe-interval", "0")
        peers = [PeerProcess.launch(path, (0, 8), "--config", str(cfg)) for _ in range(3)]
        if culprit:
            sys.path.insert(0, str(REPO))
            from tests import dishonest

            bad = dishonest.launch(path, (0, 8), 0.1, "--config", str(cfg), seed=11)
        for p in [*peers, *([bad] if bad else [])]:
            p.wait_ready(DEADLINE)
        honest = {p.peer_id for p in peers}
        dht = DHTConfig(model=model.spec.model_id, swarm_id="framing", initial_peers=tuple(boot),
                        host_maddrs=("/ip4/127.0.0.1/tcp/0",), client_mode=True, **TIMING)

        async def baseline():
            async with AsyncClient(model=path, dht_config=dht, model_info=model) as client:
                end = time.monotonic() + DEADLINE
                while time.monotonic() < end:
                    flows = await _plan_flows(client.swarm_routes)
                    if honest <= {pid for pid, rate in flows.items() if rate > 0}:
                        keys = {pid: info.reply_key for pid, info in client.swarm_routes.peers.items()}
                        return flows, keys
                    await asyncio.sleep(0.5)
                raise TimeoutError("no plan with flow through every honest peer")

        before, keys = asyncio.run(baseline())

        async def attack():
            transport = await client_transport(ClientConfig())
            try:
                return await FramingAttacker(transport, model.spec.model_id, model.spec.dtype, keys).cases(
                    [p.hop() for p in peers], 4)
            finally:
                await transport.close()

        seeds, rounding = asyncio.run(attack())
        honest_before = sum(rate for pid, rate in before.items() if pid in honest)
        for n in reporters:
            t0 = time.perf_counter()
            # each kind under n keys of its own: readers drop a record holding a malformed case whole,
            # so the honest-rounding cases reach the coordinator's judge; the seed cases do not hold
            stored = publish_from_fresh_keys(dht, rounding, n, str(work), f"rounding{n}-")
            if n == reporters[0]:  # dropped by every reader (malformed): once is enough to show it
                stored += publish_from_fresh_keys(dht, seeds, n, str(work), f"seeds{n}-")
            time.sleep(settle_s)

            async def read():  # a read that finds no plan (a loaded DHT) is a miss, not an empty plan
                async with AsyncClient(model=path, dht_config=dht, model_info=model) as client:
                    end = time.monotonic() + DEADLINE
                    flows = await _plan_flows(client.swarm_routes)
                    while not flows and time.monotonic() < end:
                        await asyncio.sleep(0.5)
                        flows = await _plan_flows(client.swarm_routes)
                    return flows

            flows = asyncio.run(read())
            log = (work / "coord.log").read_text(errors="replace")
            excluded = sorted(pid for pid in honest if f"excluding peer {pid}" in log or flows.get(pid, 0.0) <= 0)
            honest_after = sum(rate for pid, rate in flows.items() if pid in honest)
            out["reporters"][n] = {"stored": stored, "honest_exclusions": len(excluded),
                                   "honest_flow_ratio": round(honest_after / honest_before, 4) if honest_before else None,
                                   "retrials_logged": log.count("retrial of "),
                                   "wall_s": round(time.perf_counter() - t0, 1)}
            print(f"{n} Sybil reporters: {out['reporters'][n]}", flush=True)
        if bad is not None:
            out["culprit"] = _culprit(path, model, dht, bad.peer_id, honest, work, max_requests)
            print(f"culprit: {out['culprit']}", flush=True)
    finally:
        for p in [*peers, *([bad] if bad else [])]:
            p.kill()
        children.stop_all(timeout=0)
    return out


def _culprit(path, model, dht, bad: str, honest: set, work: Path, max_requests: int) -> dict:
    import dataclasses

    from p2pserve.client.api import AsyncClient
    from p2pserve.config import ClientConfig

    config = ClientConfig(verify_share=0.02, hop_timeout_s=30.0, max_retries=3)
    dht = dataclasses.replace(dht, key_path=str(work / "untrusted-client.key"))

    async def main():
        async with AsyncClient(model=path, dht_config=dht, config=config, seed=9, model_info=model) as client:
            banned = dropped = None
            for i in range(max_requests):
                await client.generate([1 + i % 7, 5, 9, 13], max_new_tokens=16, ignore_eos=True)
                if banned is None and bad in client.verifier.excluded:
                    banned = i + 1
                if banned is not None and i % 5 == 0:
                    flows = await _plan_flows(client.swarm_routes)
                    if flows and bad not in flows:
                        dropped = i + 1
                        break
            return banned, dropped, client.verifier.stats

    banned, dropped, stats = asyncio.run(main())
    log = (work / "coord.log").read_text(errors="replace")
    return {"requests_to_client_ban": banned, "requests_to_plan_exclusion": dropped,
            "honest_exclusions": sum(f"excluding peer {pid}" in log for pid in honest),
            "verified_steps": stats.verified, "mismatches": stats.mismatches}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reporters", default="3,10,30")
    ap.add_argument("--culprit", action="store_true", help="also measure a corrupting peer's conviction")
    ap.add_argument("--settle", type=float, default=8.0, help="seconds of coordinator rounds after each attack")
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "framing.json"))
    args = ap.parse_args()
    out = measure(tuple(int(x) for x in args.reporters.split(",")), args.culprit, args.settle)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
