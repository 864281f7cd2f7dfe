"""Throwaway client keys cannot frame honest peers; the coordinator convicts only on its own re-execution.

Real processes on loopback: a bootstrap node, a coordinator with the default policy (no trusted
verifier), three honest peers and one corrupting peer (``tests/dishonest.py``), all serving the
whole tiny 8-layer Llama.

* **The framing attack.** The attacker holds no peer. It opens ordinary sessions on the honest
  peers and files what they signed as evidence under three fresh DHT keys: tokens sampled at
  temperature 1.5 with different seeds (the witnesses with one seed, the accused with another), and
  the accused's four positions run one by one against the witnesses' one prefill, offered as a
  mismatch. Every claim binds its sampling parameters, its kind of output and its dtype, so the
  first case does not hold and the second is honest rounding within tolerance; and even a case
  that held would only be a reason for the coordinator to look. Asserted: no honest peer leaves
  the plan, the plan's flow stays, and a client's greedy output through the honest peers is
  token-identical to ``generate`` (the corrupting peer is still in the swarm: a client reading
  the plan could draw it, and the next test is the one that catches it).
* **A real culprit is still convicted.** A client whose key nobody trusts checks every request,
  catches the corrupting peer and publishes its signed case; the coordinator re-executes the step
  on replicas it chooses, finds the accused's signed output wrong, and drops it from the plan.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from p2pserve.cli.common import write_local_swarm_file
from p2pserve.client.api import AsyncClient
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.client.node import client_transport
from p2pserve.config import ClientConfig, DHTConfig
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.evidence import Evidence
from p2pserve.launch import Children, PeerProcess
from p2pserve.testing.framing import PROMPT, FramingAttacker, publish_from_fresh_keys
from tests import dishonest
from tests.harness import reference_generate

pytestmark = pytest.mark.integration

SWARM_ID = "framing-swarm"
TIMING = dict(peer_refresh=0.5, candidate_refresh=0.5, plan_refresh=1.0, link_refresh=5.0, max_clock_skew=2.0)
DEADLINE = 120.0  # generous for a loaded two-core machine, not a performance claim
NEW_TOKENS = 12


async def _until(fn, what: str, deadline: float = DEADLINE):
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        value = await fn()
        if value:
            return value
        await asyncio.sleep(0.3)
    raise TimeoutError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def swarm(model_dir, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("framing_swarm")
    children = Children(logdir)
    path = model_dir("llama")
    model = LocalModelInfo.load(path)
    peers, bad = [], None
    try:
        maddrs_file = logdir / "boot.maddrs"
        children.start("boot", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--maddrs-file", str(maddrs_file))
        end = time.monotonic() + DEADLINE
        while not maddrs_file.exists() and time.monotonic() < end:
            time.sleep(0.2)
        boot = maddrs_file.read_text().split()
        cfg = logdir / "swarm.json"
        write_local_swarm_file(cfg, model.spec, boot, SWARM_ID, "/ip4/127.0.0.1/tcp/0", TIMING, 0.5)
        children.start("coord", "coordinator", "--config", str(cfg))
        peers = [PeerProcess.launch(path, (0, 8), "--config", str(cfg)) for _ in range(3)]
        bad = dishonest.launch(path, (0, 8), 0.1, "--config", str(cfg), seed=11)
        for p in [*peers, bad]:
            p.wait_ready(DEADLINE)
        dht = DHTConfig(model=model.spec.model_id, swarm_id=SWARM_ID, initial_peers=tuple(boot),
                        host_maddrs=("/ip4/127.0.0.1/tcp/0",), client_mode=True, **TIMING)
        yield dict(model=model, path=path, dht=dht, honest=peers, bad=bad.peer_id, logdir=logdir)
    finally:
        for p in [*peers, bad]:
            if p is not None:
                p.kill()
        children.stop_all(timeout=0)


async def _frame(swarm) -> tuple[list, list]:
    """The attacker's cases against each honest peer, from their own signed replies."""
    model = swarm["model"]
    async with AsyncClient(model=swarm["path"], dht_config=swarm["dht"], model_info=model) as client:
        await client.swarm_routes.refresh(force=True)
        keys = {pid: info.reply_key for pid, info in client.swarm_routes.peers.items()}
    transport = await client_transport(ClientConfig())
    try:
        attacker = FramingAttacker(transport, model.spec.model_id, model.spec.dtype, keys)
        return await attacker.cases([p.hop() for p in swarm["honest"]], 4)
    finally:
        await transport.close()


def test_sybil_reporters_with_no_colluding_peer_exclude_no_honest_peer(swarm, tmp_path):
    model, path, honest = swarm["model"], swarm["path"], {p.peer_id for p in swarm["honest"]}
    members = honest | {swarm["bad"]}
    ref = reference_generate(path, PROMPT, NEW_TOKENS)

    async def plan():
        # Every peer, the corrupting one too: a plan made before the last peer joined would compare
        # a join's re-balancing of the flows with what the evidence did.
        async with AsyncClient(model=path, dht_config=swarm["dht"], model_info=model) as client:
            routes = client.swarm_routes

            async def everyone():
                await routes.refresh(force=True)
                p = routes.plan
                return p if p is not None and members <= set(p.spans) and all(
                    any(f.src == pid and f.rate > 0 for f in p.flows) for pid in members) else None

            return await _until(everyone, "a plan with flow through every peer")

    before = asyncio.run(plan())
    seeds, rounding = asyncio.run(_frame(swarm))
    # each kind under three keys of its own: a record holding a malformed case is dropped whole
    assert publish_from_fresh_keys(swarm["dht"], seeds, 3, str(tmp_path), "seeds") == 3
    assert publish_from_fresh_keys(swarm["dht"], rounding, 3, str(tmp_path), "rounding") == 3

    async def after():
        async with AsyncClient(model=path, dht_config=swarm["dht"], model_info=model,
                               config=ClientConfig(hop_timeout_s=30.0)) as client:
            async def published():
                found = await client._swarm.read(RecordKind.EVIDENCE, Evidence)
                return found if len([s for s in found if s.record.cases]) >= 3 else None

            evidence = await _until(published, "the Sybils' evidence")
            routes = client.swarm_routes
            plans = []
            for _ in range(8):  # several coordinator rounds after the evidence is readable
                await asyncio.sleep(1.0)
                await routes.refresh(force=True)
                plans.append(routes.plan)
            return evidence, plans

    async def served():
        # The corrupting peer is still in the swarm, so the honest peers' output is read from them.
        entries = [(p.maddrs[0], *p.layers) for p in swarm["honest"]]
        async with AsyncClient(peers=entries, model=path, model_info=model,
                               config=ClientConfig(hop_timeout_s=30.0)) as client:
            return await client.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)

    evidence, plans = asyncio.run(after())
    reply = asyncio.run(served())
    # the rounding cases were published and read (the seed cases are dropped by every reader: their
    # witnesses signed other sampling parameters than the accused)
    assert len([s for s in evidence if s.record.cases]) >= 3
    for p in plans:
        assert honest <= set(p.spans), f"honest peers left the plan: {honest - set(p.spans)}"
        flow = {pid: sum(f.rate for f in p.flows if f.src == pid) for pid in honest}
        assert all(rate > 0 for rate in flow.values()), flow
    # The plan's flow stays. Not the honest peers' share of it: peers that serve the same layers
    # are interchangeable to the max-flow, and a re-solve may split an equal total another way.
    total_flow = lambda p: sum(f.rate for f in p.flows if f.src in members)  # noqa: E731
    assert total_flow(plans[-1]) >= total_flow(before) * (1 - 1e-6)
    assert reply.tokens == ref
    log = (swarm["logdir"] / "coord.log").read_text(errors="replace") if (swarm["logdir"] / "coord.log").exists() else ""
    assert not any(f"excluding peer {pid}" in log for pid in honest)


def test_a_corrupting_peer_is_convicted_on_the_coordinators_own_re_execution(swarm, tmp_path):
    model, path, bad = swarm["model"], swarm["path"], swarm["bad"]
    honest = {p.peer_id for p in swarm["honest"]}
    config = ClientConfig(verify_share=0.02, verify_every_request=True, verify_hold=True, hop_timeout_s=30.0,
                          max_retries=3)
    dht = dataclasses.replace(swarm["dht"], key_path=str(tmp_path / "nobody-trusts-me.key"))

    async def main():
        async with AsyncClient(model=path, dht_config=dht, config=config, seed=9, model_info=model) as client:
            routes = client.swarm_routes
            caught = None
            for i in range(60):
                await client.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
                if bad in client.verifier.excluded:
                    caught = i
                    break
            await client.verifier.drain()

            async def dropped():
                await routes.refresh(force=True)
                return routes.plan is not None and bad not in routes.plan.spans

            await _until(dropped, "the plan without the corrupting peer")
            return caught, routes.plan

    caught, plan = asyncio.run(main())
    assert caught is not None
    assert bad not in plan.spans and honest <= set(plan.spans)
    log = (swarm["logdir"] / "coord.log").read_text(errors="replace")
    assert f"excluding peer {bad}: re-executed by the coordinator" in log
