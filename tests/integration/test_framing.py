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
  the plan, the plan's flow stays, and a client's greedy output through the swarm is
  token-identical to ``generate``.
* **A real culprit is still convicted.** A client whose key nobody trusts checks every request,
  catches the corrupting peer and publishes its signed case; the coordinator re-executes the step
  on replicas it chooses, finds the accused's signed output wrong, and drops it from the plan.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch

from p2pserve.cli.common import write_local_swarm_file
from p2pserve.client.api import AsyncClient
from p2pserve.client.connection import HopConnection
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.client.node import client_transport
from p2pserve.config import ClientConfig, DHTConfig
from p2pserve.dht.evidence import Evidence, InputChain, Mismatch, SignedClaim, make_claim, output_digest, row_digests
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.records import encode_record
from p2pserve.dht.swarm import Swarm
from p2pserve.launch import Children, PeerProcess
from p2pserve.protocol import SamplingParams
from p2pserve.transport.frames import tensor_to_wire
from tests import dishonest
from tests.harness import reference_generate

pytestmark = pytest.mark.integration

SWARM_ID = "framing-swarm"
TIMING = dict(peer_refresh=0.5, candidate_refresh=0.5, plan_refresh=1.0, link_refresh=5.0, max_clock_skew=2.0)
DEADLINE = 120.0  # generous for a loaded two-core machine, not a performance claim
PROMPT = [1, 5, 9, 13]
NEW_TOKENS = 12
LIMITS = ClientConfig().frame_limits


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


class _Attacker:
    """Ordinary sessions on honest peers, and the claims those peers signed, as an attacker sees them."""

    def __init__(self, transport, model: LocalModelInfo):
        self.transport, self.model = transport, model

    async def run(self, peer: PeerProcess, start: int, end: int, steps: list[list[int]], sampling: SamplingParams,
                  sid: str) -> tuple[SignedClaim, bytes, bytes]:
        """Send ``steps`` (token rows) in turn; the signed claim of the last reply, its output
        bytes, and every input row sent (the history)."""
        conn = HopConnection(self.transport, peer.hop(start, end), LIMITS, 30)
        await conn.open(self.model.spec.model_id, sid, 64, sampling)
        chain, position, history = InputChain(), 0, b""
        try:
            for i, rows in enumerate(steps):
                ids = torch.tensor(rows)
                reply, hidden = await conn.forward(i, position, ids)
                data = bytes(tensor_to_wire(ids)[1])
                history += data
                commitment = chain.extend(row_digests(data, len(rows)))
                count, at = len(rows), position
                position += len(rows)
        finally:
            await conn.close()
        out = bytes(tensor_to_wire(hidden)[1]) if hidden is not None else b""
        kind = "hidden" if hidden is not None else "token"
        claim = make_claim(model=self.model.spec.model_id, peer_id=peer.peer_id, session_id=sid, start=start, end=end,
                           position=at, count=count, commitment=commitment,
                           output=output_digest(out, None if hidden is not None else reply.token), kind=kind,
                           dtype=self.model.spec.dtype, sampling=sampling)
        return SignedClaim(claim, reply.signature, ""), out, history


async def _frame(swarm) -> list[Mismatch]:
    """Cases against each honest peer, from the honest peers' own signed replies."""
    model, honest = swarm["model"], swarm["honest"]
    keys = {}
    async with AsyncClient(model=swarm["path"], dht_config=swarm["dht"], model_info=model) as client:
        await client.swarm_routes.refresh(force=True)
        keys = {pid: info.reply_key for pid, info in client.swarm_routes.peers.items()}
    transport = await client_transport(ClientConfig())
    attacker = _Attacker(transport, model)
    cases = []
    try:
        for i, accused in enumerate(honest):
            witnesses = [p for p in honest if p is not accused]
            # 1. tokens sampled with other seeds: the witnesses share one, the accused has its own
            hot = lambda seed: SamplingParams(temperature=1.5, seed=seed)  # noqa: E731
            signed_w = [await attacker.run(w, 0, 8, [PROMPT], hot(100), f"w{i}{j}") for j, w in enumerate(witnesses)]
            for seed in range(1, 40):
                a = await attacker.run(accused, 0, 8, [PROMPT], hot(seed), f"a{i}-{seed}")
                if a[0].claim.output != signed_w[0][0].claim.output:
                    break
            cases.append(_case(a, signed_w, keys))
            # 2. the accused runs four positions one by one, the witnesses the first three as one
            # prefill, then the fourth: the same inputs, honest rounding (relative L2 ~1e-7)
            step_by_step = await attacker.run(accused, 0, 4, [[t] for t in PROMPT], SamplingParams(), f"s{i}")
            prefill = [await attacker.run(w, 0, 4, [PROMPT[:3], PROMPT[3:]], SamplingParams(), f"p{i}{j}")
                       for j, w in enumerate(witnesses)]
            cases.append(_case(step_by_step, prefill, keys))
    finally:
        await transport.close()
    return cases


def _case(accused, witnesses, keys) -> Mismatch:
    def signed(entry):
        claim = entry[0]
        return SignedClaim(claim.claim, claim.signature, keys.get(claim.claim.peer_id, ""))

    return Mismatch(accused=signed(accused), witnesses=[signed(w) for w in witnesses],
                    outputs=[accused[1], *[w[1] for w in witnesses]] if accused[1] else [], history=accused[2])


def _publish_from_fresh_keys(swarm, cases: list[Mismatch], reporters: int, tmp_path, name: str) -> None:
    """``cases`` under ``reporters`` fresh DHT keys each, stored raw: an attacker skips the
    validation an honest client runs before it publishes (``Swarm._check_own``)."""
    for r in range(reporters):
        dht = dataclasses.replace(swarm["dht"], key_path=str(tmp_path / f"{name}{r}.key"))
        node = Swarm.create(dht)
        try:
            record = Evidence(model=dht.model, reporter_id=node.peer_id, cases=cases[:8], timestamp=time.time())
            assert asyncio.run(node._put(RecordKind.EVIDENCE, encode_record(record), 600))
        finally:
            node.shutdown()


def test_sybil_reporters_with_no_colluding_peer_exclude_no_honest_peer(swarm, tmp_path):
    model, path, honest = swarm["model"], swarm["path"], {p.peer_id for p in swarm["honest"]}
    ref = reference_generate(path, PROMPT, NEW_TOKENS)

    async def plan():
        async with AsyncClient(model=path, dht_config=swarm["dht"], model_info=model) as client:
            routes = client.swarm_routes

            async def everyone():
                await routes.refresh(force=True)
                p = routes.plan
                return p if p is not None and honest <= set(p.spans) and all(
                    any(f.src == pid and f.rate > 0 for f in p.flows) for pid in honest) else None

            return await _until(everyone, "a plan with flow through every honest peer")

    before = asyncio.run(plan())
    cases = asyncio.run(_frame(swarm))
    # the sampled-token cases (even indices) and the rounding cases (odd) under three keys each: a
    # record holding a malformed case is dropped whole by readers, so each kind gets its own
    _publish_from_fresh_keys(swarm, cases[0::2], 3, tmp_path, "seeds")
    _publish_from_fresh_keys(swarm, cases[1::2], 3, tmp_path, "rounding")

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
            reply = await client.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            return evidence, plans, reply

    evidence, plans, reply = asyncio.run(after())
    # the rounding cases were published and read (the seed cases are dropped by every reader: their
    # witnesses signed other sampling parameters than the accused)
    assert len([s for s in evidence if s.record.cases]) >= 3
    for p in plans:
        assert honest <= set(p.spans), f"honest peers left the plan: {honest - set(p.spans)}"
        flow = {pid: sum(f.rate for f in p.flows if f.src == pid) for pid in honest}
        assert all(rate > 0 for rate in flow.values()), flow
    honest_flow = lambda p: sum(f.rate for f in p.flows if f.src in honest)  # noqa: E731
    assert honest_flow(plans[-1]) >= honest_flow(before) * (1 - 1e-6)
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
