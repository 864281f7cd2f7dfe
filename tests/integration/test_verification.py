"""A peer that corrupts 10% of its steps is caught by 2% verification and leaves the plan.

Real processes on loopback: a bootstrap node, a coordinator trusting this test's client as a
verifier, and four peers with fixed ranges on the tiny 8-layer Llama: the dishonest one
(``tests/dishonest.py``) serving layers [0, 4), an honest one serving [4, 8), and two honest ones
serving the whole model. The plan's max-flow needs the chain ``dishonest[0:4) -> tail[4:8)`` (the
tail's capacity is reachable no other way), so the dishonest peer carries a share of the routes;
the two whole-model peers are the replicas its [0, 4) replies are checked against.

What is asserted, request by request (at most 200 requests, 24 greedy tokens each):

* before the dishonest peer is caught, every request whose route avoided it is token-identical
  to single-process ``generate``; requests through it may not be (verification runs off the
  critical path, and samples steps, so a corrupted step reaches the user until the peer is caught);
* the request in which the client caught it, and every request after, is token-identical: the
  client runs with ``verify_hold`` (a request awaits the checks drawn on its own steps), and a
  proven culprit rolls the request back to the first token it touched and regenerates it on a
  route without it (``client/trust/rollback.py``);
* the client bans it locally at its first proven mismatch, publishes signed evidence, and the
  coordinator's plan drops it: all within 200 requests at ``verify_share=0.02``;
* once the plan dropped it, no route includes it and every request is token-identical again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from p2pserve.cli.common import write_local_swarm_file
from p2pserve.client.api import AsyncClient
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.config import ClientConfig, DHTConfig
from p2pserve.dht.evidence import Evidence, self_evident
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.signing import load_or_create_key, public_key_text
from p2pserve.launch import Children
from tests import dishonest
from tests.harness import reference_generate

pytestmark = pytest.mark.integration

SWARM_ID = "verify-swarm"
TIMING = dict(peer_refresh=0.5, candidate_refresh=0.5, plan_refresh=1.0, link_refresh=5.0, max_clock_skew=2.0)
DEADLINE = 120.0  # generous for a loaded two-core machine, not a performance claim
MAX_REQUESTS = 200
PROMPTS = [[1, 5, 9, 13], [2, 4, 8, 16, 32], [3, 7, 11], [6, 10, 20, 30, 40, 50]]
NEW_TOKENS = 24
EVERY_REQUEST_MAX = 40  # a request through the dishonest peer carries a corrupted step w.p. 1 - 0.9^24 = 0.92


async def _until(fn, what: str):
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        value = await fn()
        if value:
            return value
        await asyncio.sleep(0.3)
    raise TimeoutError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def swarm(model_dir, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("verify_swarm")
    children = Children(logdir)
    path = model_dir("llama")
    model = LocalModelInfo.load(path)
    key_path = str(logdir / "client.key")
    client_key = public_key_text(load_or_create_key(key_path))
    bad = None
    try:
        maddrs_file = logdir / "boot.maddrs"
        children.start("boot", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--maddrs-file", str(maddrs_file))
        end = time.monotonic() + DEADLINE
        while not maddrs_file.exists() and time.monotonic() < end:
            time.sleep(0.2)
        boot = maddrs_file.read_text().split()
        cfg = logdir / "swarm.json"
        write_local_swarm_file(cfg, model.spec, boot, SWARM_ID, "/ip4/127.0.0.1/tcp/0", TIMING, 0.5)
        children.start("coord", "coordinator", "--config", str(cfg), "--trusted-verifier", client_key,
                       "--retrial-replicas", "0")  # only the trusted verifier excludes here
        for name, layers in (("whole1", "0:8"), ("whole2", "0:8"), ("tail", "4:8")):
            children.start(name, "peer", "--model", path, "--config", str(cfg), "--num-threads", "1",
                           "--layers", layers)
        bad = dishonest.launch(path, (0, 4), 0.1, "--config", str(cfg), seed=7)
        bad.wait_ready(DEADLINE)
        dht = DHTConfig(model=model.spec.model_id, swarm_id=SWARM_ID, initial_peers=tuple(boot),
                        host_maddrs=("/ip4/127.0.0.1/tcp/0",), client_mode=True, key_path=key_path, **TIMING)
        yield dict(model=model, path=path, dht=dht, bad=bad.peer_id)
    finally:
        if bad is not None:
            bad.kill()
        children.stop_all(timeout=0)


def test_every_request_checked_before_it_returns_is_identical_throughout(swarm, tmp_path):
    """``verify_every_request`` with ``verify_hold``: every hop of every request is checked before
    the request returns, so a request through the corrupting peer is caught and regenerated in the
    same request, and *every* request is token-identical to ``generate``. Runs first, with a key the
    coordinator does not trust: its evidence alone does not drop the peer from the plan, which the
    next test needs."""
    model, path, bad = swarm["model"], swarm["path"], swarm["bad"]
    refs = [reference_generate(path, p, NEW_TOKENS) for p in PROMPTS]
    config = ClientConfig(verify_share=0.02, verify_hold=True, verify_every_request=True, hop_timeout_s=30.0,
                          max_retries=3)
    dht = dataclasses.replace(swarm["dht"], key_path=str(tmp_path / "untrusted.key"))

    async def main():
        async with AsyncClient(model=path, dht_config=dht, config=config, seed=5, model_info=model) as client:
            routes = client.swarm_routes

            async def flow_through_bad():
                await routes.refresh(force=True)
                return routes.plan is not None and any(f.src == bad and f.rate > 0 for f in routes.plan.flows)

            await _until(flow_through_bad, "a plan with flow through the dishonest peer")
            log, caught_at = [], None
            for i in range(EVERY_REQUEST_MAX):
                prompt = i % len(PROMPTS)
                reply = await client.generate(PROMPTS[prompt], max_new_tokens=NEW_TOKENS, ignore_eos=True)
                log.append(({h.peer_id for r in reply.routes for h in r}, reply.tokens == refs[prompt], reply.rolled_back))
                if caught_at is None and bad in client.verifier.excluded:
                    caught_at = i
                if caught_at is not None and i >= caught_at + 3:
                    break
            return log, caught_at, client.verifier.stats

    log, caught_at, stats = asyncio.run(main())
    print(f"caught at request {caught_at}; rolled back: {[(i, n) for i, (_, _, n) in enumerate(log) if n]}; {stats}")
    assert caught_at is not None, f"not caught in {len(log)} requests: {stats}"
    assert log[caught_at][2] > 0  # the catching request went through it, was rolled back and regenerated
    assert all(same for _, same, _ in log), [i for i, (_, same, _) in enumerate(log) if not same]


def test_a_corrupting_peer_is_excluded_and_output_stays_identical_after(swarm):
    model, path, bad = swarm["model"], swarm["path"], swarm["bad"]
    refs = [reference_generate(path, p, NEW_TOKENS) for p in PROMPTS]
    config = ClientConfig(verify_share=0.02, verify_hold=True, hop_timeout_s=30.0, max_retries=3)

    async def main():
        async with AsyncClient(model=path, dht_config=swarm["dht"], config=config, seed=3, model_info=model) as client:
            routes = client.swarm_routes

            async def plan_has_everyone():
                await routes.refresh(force=True)
                plan = routes.plan
                return plan is not None and len(plan.spans) == 4 and any(f.src == bad and f.rate > 0 for f in plan.flows)

            await _until(plan_has_everyone, "a plan over all four peers with flow through the dishonest one")
            log = []  # (request, route peer ids, identical to generate)
            excluded_at = banned_at = None
            for i in range(MAX_REQUESTS):
                prompt = i % len(PROMPTS)
                reply = await client.generate(PROMPTS[prompt], max_new_tokens=NEW_TOKENS, ignore_eos=True)
                hops = {h.peer_id for r in reply.routes for h in r}
                log.append((i, hops, reply.tokens == refs[prompt], reply.rolled_back))
                if banned_at is None and bad in client.verifier.excluded:
                    banned_at = i
                if banned_at is not None and i % 5 == 0:
                    await routes.refresh(force=True)
                    if bad not in routes.plan.spans:
                        excluded_at = i
                        break
            await client.verifier.drain()
            after = [await client.generate(p, max_new_tokens=NEW_TOKENS, ignore_eos=True) for p in PROMPTS]
            evidence = await client._swarm.read(RecordKind.EVIDENCE, Evidence)
            return log, banned_at, excluded_at, after, evidence, client.verifier.stats, client._swarm.peer_id

    log, banned_at, excluded_at, after, evidence, stats, me = asyncio.run(main())
    through = sum(bad in hops for _, hops, _, _ in log)
    wrong = sum(bad in hops and not same for _, hops, same, _ in log)
    rolled = [(i, n) for i, _, _, n in log if n]
    print(f"banned after {banned_at}, out of the plan after {excluded_at} requests; {through} went through the "
          f"dishonest peer, {wrong} of them not identical to generate; rolled back (request, tokens): {rolled}; "
          f"{stats}")
    assert banned_at is not None, f"not caught in {MAX_REQUESTS} requests: {stats}"
    assert through > 0  # it was caught serving, not only as someone else's witness
    assert excluded_at is not None and excluded_at < MAX_REQUESTS
    # before: requests that avoided the dishonest peer are exact
    assert all(same for _, hops, same, _ in log if bad not in hops)
    # from the request in which it was caught on: exact, whatever the route (rolled back and regenerated)
    assert all(same for i, _, same, _ in log if i >= banned_at), [i for i, _, same, _ in log if not same]
    assert any(n for i, _, _, n in log if i == banned_at) or log[banned_at][2]
    # after: it is on no route, and every request is exact
    assert all(bad not in {h.peer_id for r in a.routes for h in r} for a in after)
    assert [a.tokens for a in after] == refs
    # the evidence is ours, and names the dishonest peer under signatures
    ours = [s.record for s in evidence if s.record.reporter_id == me]
    assert ours and ours[0].cases[0].accused.claim.peer_id == bad
    assert all(c.accused.valid() and all(w.valid() for w in c.witnesses) for c in ours[0].cases)
    # and its signed outputs convict it without trusting our comparison (any coordinator can check)
    assert all(self_evident(c) is None for c in ours[0].cases)
