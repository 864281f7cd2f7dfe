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
