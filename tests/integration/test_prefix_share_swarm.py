"""Prefix sharing through real peer processes: sessions that open with one long system prompt
share its KV blocks on every hop (keyed by the token ids on the first hop, by the hidden-state
bytes on the second), and their greedy output still equals single-process `generate`."""

from __future__ import annotations

import asyncio

import pytest

from p2pserve.client.connection import HopConnection
from p2pserve.client.generation import generate
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.client.params import GenerationParams
from p2pserve.config import ClientConfig
from p2pserve.peer.kv_cache import BLOCK_SIZE
from tests.harness import client_node, open_chain_pipeline, reference_generate, start_peers

pytestmark = pytest.mark.integration

GREEDY = GenerationParams(max_new_tokens=12, ignore_eos=True)
SYSTEM = ("You are a careful assistant of a peer-to-peer swarm. Answer briefly, in plain words, "
          "and say so when you do not know. Never invent numbers; show the steps of any sum.")


def test_sessions_sharing_a_system_prompt_share_blocks_on_every_hop_and_stay_exact(model_dir):
    path = model_dir("llama")
    peers = start_peers(path, [(0, 4), (4, 8)])
    try:
        model = LocalModelInfo.load(path)
        prompts = [model.chat_ids([{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": f"What is {i} plus {i}?"}]) for i in range(3)]
        common = next(j for j in range(len(prompts[0])) if prompts[0][j] != prompts[1][j])
        assert common >= 2 * BLOCK_SIZE, "the system prompt should fill whole blocks"
        refs = [reference_generate(path, p, GREEDY.max_new_tokens) for p in prompts]

        async def main():
            async with client_node() as transport:
                hops = [p.hop() for p in peers]
                pipelines = [await open_chain_pipeline(transport, hops, model, 512, GREEDY) for _ in prompts]
                outs = []
                for s, p in zip(pipelines, prompts):  # one after another: all open at the end
                    outs.append((await generate(s, p, GREEDY, model.eos_ids)).tokens)
                used = []
                for hop in hops:
                    conn = HopConnection(transport, hop, ClientConfig().frame_limits, 10)
                    st = await conn.stats()
                    used.append(st.kv_capacity_token_layers - st.kv_free_token_layers)
                    await conn.close()
                for s in pipelines:
                    await s.close()
                return outs, used

        outs, used = asyncio.run(main())
        for ours, ref in zip(outs, refs):
            assert ours[: len(ref)] == ref
        for u in used:  # each hop holds 4 layers; unshared, every session would hold all its blocks
            held = sum(-(-(len(p) + len(o)) // BLOCK_SIZE) * BLOCK_SIZE * 4 for p, o in zip(prompts, outs))
            shared = 2 * (common // BLOCK_SIZE) * BLOCK_SIZE * 4  # the 2nd and 3rd session's system blocks
            assert u <= held - shared, f"hop holds {u} token-layers; unshared {held}"
    finally:
        for p in peers:
            p.stop()


async def _used(transport, hop) -> int:
    conn = HopConnection(transport, hop, ClientConfig().frame_limits, 10)
    st = await conn.stats()
    await conn.close()
    return st.kv_capacity_token_layers - st.kv_free_token_layers


async def _guess_deltas(peer, model, secret: list[int], candidates: list[list[int]]) -> list[int]:
    """A victim caches ``secret`` + one token on ``peer``; another node sends each candidate block
    + one token in a session of its own, and reads the peer's free KV figure (which anyone may ask
    for) before and after: how much each guess made the peer hold."""
    import torch

    from p2pserve.protocol import SamplingParams

    hop = peer.hop()
    async with client_node() as victim, client_node() as attacker:
        mine = HopConnection(victim, hop, ClientConfig().frame_limits, 30)
        await mine.open(model.spec.model_id, None, 64, SamplingParams())
        await mine.forward(0, 0, torch.tensor(secret + [7]))
        deltas = []
        for guess in candidates:
            before = await _used(attacker, hop)
            conn = HopConnection(attacker, hop, ClientConfig().frame_limits, 30)
            await conn.open(model.spec.model_id, None, 64, SamplingParams())
            await conn.forward(0, 0, torch.tensor(guess + [7]))
            deltas.append(await _used(attacker, hop) - before)
            await conn.close()
        await mine.close()
    return deltas


def test_another_users_cached_prompt_cannot_be_picked_out_by_the_free_kv_figure(model_dir):
    """A block of another user's prompt, guessed among twelve candidates: with the default scope
    (sharing within one owner's sessions) every guess costs the peer the same KV, so the free
    figure says nothing; a peer sharing globally (``--prefix-sharing global``) would give the
    secret away, shown here as the control."""
    import random

    path = model_dir("llama")
    model = LocalModelInfo.load(path)
    rng = random.Random(3)
    candidates = [[rng.randrange(3, 250) for _ in range(BLOCK_SIZE)] for _ in range(12)]
    secret = candidates[5]
    (owner_scoped,) = start_peers(path, [(0, 8)])
    try:
        deltas = asyncio.run(_guess_deltas(owner_scoped, model, secret, candidates))
    finally:
        owner_scoped.stop()
    assert len(set(deltas)) == 1, deltas  # the secret's guess looks like every other
    (global_scope,) = start_peers(path, [(0, 8)], "--prefix-sharing", "global", "--kv-token-layers", str(8 * 64 * 16))
    try:
        control = asyncio.run(_guess_deltas(global_scope, model, secret, candidates))
    finally:
        global_scope.stop()
    assert len(set(control)) == 2 and control.count(min(control)) == 1 and control.index(min(control)) == 5, control


async def _computed(hops) -> list[int]:
    """Positions each hop's peer has run through its layers so far (``PeerStats.tokens``)."""
    async with client_node() as transport:
        out = []
        for hop in hops:
            conn = HopConnection(transport, hop, ClientConfig().frame_limits, 10)
            out.append((await conn.stats()).tokens)
            await conn.close()
        return out


def test_n_choices_compute_the_prompt_once(model_dir):
    """``n`` = 4 choices through real peers: the later choices fork the first one's sessions, so
    each peer computes the prompt once plus its last position per later choice (whose logits each
    choice samples its own first token from), and greedy choices equal single-process `generate`;
    a sampled choice equals the same seed asked for alone."""
    import p2pserve

    path = model_dir("llama")
    peers = start_peers(path, [(0, 4), (4, 8)])
    try:
        model = LocalModelInfo.load(path)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2 plus 2?"}]
        ids, n, new = model.chat_ids(messages), 4, 6
        ref = reference_generate(path, ids, new)
        hops = [p.hop() for p in peers]
        with p2pserve.Client(peers=[(p.maddrs[0], *p.layers) for p in peers], model=path, verify_share=0.0) as client:
            before = asyncio.run(_computed(hops))
            replies = client.chat(messages, n=n, max_new_tokens=new, ignore_eos=True)
            after = asyncio.run(_computed(hops))
            sampled = client.chat(messages, n=2, max_new_tokens=new, ignore_eos=True, temperature=1.0, seed=5)
            alone = client.chat(messages, max_new_tokens=new, ignore_eos=True, temperature=1.0, seed=6)
        assert [r.tokens for r in replies] == [ref] * n
        once = len(ids) + (n - 1) + n * (new - 1)  # the prompt, its last row again per fork, the decode steps
        unshared = n * len(ids) + n * (new - 1)
        assert [a - b for a, b in zip(after, before)] == [once] * len(hops), (before, after, once, unshared)
        assert sampled[1].tokens == alone.tokens
    finally:
        for p in peers:
            p.stop()
