"""Routed-experts families (Qwen3-MoE, Mixtral, GLM-4.5, GPT-OSS, DeepSeek-V3) through real peer processes, on every path.

Each folder is built by `p2pserve.model.tiny_families` from the family's real config.json
(Qwen3-30B-A3B, Mixtral-8x7B-Instruct, GLM-4.5 with its shared expert and partial rotary,
gpt-oss-20b with attention sinks, alternating window/full layers and YaRN, DeepSeek-V3 with
multi-head latent attention (its peers' pools hold the latent), YaRN and grouped routing; 8
experts, top-2) and saved as the hub saves it (one matrix per expert; GPT-OSS's fused, as its own
checkpoints). Peers are `p2pserve peer --model PATH --layers A:B` processes. Against transformers
`generate` on the same folder in fp32, token for token:

* the public `p2pserve.Client` over three peers [0, 2), [2, 4), [4, 6);
* a route whose last peer is SIGKILLed mid-stream: the client fails over to its replica and replays;
* for Qwen3-MoE also speculative decoding (prompt lookup: multi-row verification on the last
  peer), and for Qwen3-MoE and GPT-OSS (attention sinks) three sessions sharing a long system
  prompt, generated concurrently (the peers batch them into one step and share their prefix KV
  blocks). Both paths are the family's layer math
  in another arrangement, which tests/unit/model/test_moe_families.py checks for every family (batched
  sessions, speculative rows); here they run once to keep the suite's time;
* int8 and int4 routes (experts quantized too) against the same quantization in one process, for
  Qwen3-MoE, GPT-OSS and DeepSeek-V3 (whose latent projections are quantized too).
"""

from __future__ import annotations

import asyncio

import pytest

import p2pserve
from p2pserve.client.generation import generate
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.client.params import GenerationParams
from p2pserve.model.tiny_families import build_family_model
from tests.harness import client_node, open_chain_pipeline, run_chain, start_peers
from tests.integration.test_failover import generate_with_kills
from tests.integration.test_families import MESSAGE, reference

pytestmark = pytest.mark.integration

NEW_TOKENS = 24
SYSTEM = ("You are a careful assistant of a peer-to-peer swarm. Answer briefly, in plain words, "
          "and say so when you do not know. Never invent numbers; show the steps of any sum.")


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral", "glm4.5", "gpt-oss", "deepseek-v3"])
def test_moe_family_through_peers_on_every_path(tmp_path_factory, family):
    path = str(build_family_model(family, tmp_path_factory.mktemp(family) / family, seed=0))
    info = LocalModelInfo.load(path)
    chat = [{"role": "user", "content": MESSAGE}]
    ids = info.chat_ids(chat)
    ref = reference(path, ids, NEW_TOKENS)
    # three hops, and a replica of the last one for the failover part
    peers = start_peers(path, [(0, 2), (2, 4), (4, 6), (4, 6)])
    try:
        chain = [(p.maddrs[0], *p.layers) for p in peers[:3]]
        with p2pserve.Client(peers=chain, model=path) as client:
            reply = client.chat(chat, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        assert reply.tokens == ref and [h.start for h in reply.route] == [0, 2, 4]
        if family == "qwen3-moe":
            with p2pserve.Client(peers=chain, model=path, speculative="prompt-lookup") as client:
                assert client.chat(chat, max_new_tokens=NEW_TOKENS, ignore_eos=True).tokens == ref
        if family in ("qwen3-moe", "gpt-oss"):  # GPT-OSS: attention sinks in the peers' paged batch
            prompts = [info.chat_ids([{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": f"What is {i} plus {i}?"}]) for i in range(3)]
            refs = [reference(path, p, 12) for p in prompts]
            assert _concurrent(info, peers[:3], prompts, GenerationParams(max_new_tokens=12, ignore_eos=True)) == refs

        greedy = GenerationParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        tokens, pipeline = asyncio.run(generate_with_kills(path, peers, ids, greedy, {8: "last"}))
        assert tokens == ref
        assert sum(p.proc.poll() is not None for p in peers) == 1  # the route really lost a peer
    finally:
        for p in peers:
            p.stop()


def _concurrent(info, peers, prompts, params) -> list[list[int]]:
    """Greedy tokens of every prompt, all sessions open and decoding at once over ``peers``."""

    async def main():
        async with client_node() as transport:
            hops = [p.hop() for p in peers]
            pipelines = [await open_chain_pipeline(transport, hops, info, 512, params) for _ in prompts]
            try:
                results = await asyncio.gather(*(generate(s, p, params, info.eos_ids) for s, p in zip(pipelines, prompts)))
            finally:
                for s in pipelines:
                    await s.close()
            return [r.tokens for r in results]

    return asyncio.run(main())


@pytest.mark.parametrize("family", ["qwen3-moe", "gpt-oss", "deepseek-v3"])
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_moe_route_matches_in_process_quantization(tmp_path_factory, quant, family):
    """int8 over two peers (GPT-OSS's over one); int4 over one peer holding every layer (one
    process fewer: the split itself is the same code as int8's and the unquantized routes')."""
    pytest.importorskip("torchao", reason="the 'quant' extra is not installed")
    from tests.integration.test_quant import quantized_reference

    path = str(build_family_model(family, tmp_path_factory.mktemp("qmoe") / family, seed=0))
    two = quant == "int8" and family != "gpt-oss"
    peers = start_peers(path, [(0, 3), (3, 6)] if two else [(0, 6)], "--quant", quant)
    try:
        model = LocalModelInfo.load(path, quant=quant)
        ids = model.chat_ids([{"role": "user", "content": "Quantized experts, served across two peers."}])
        ref = quantized_reference(path, ids, quant)
        greedy = GenerationParams(max_new_tokens=16, ignore_eos=True)
        ours = asyncio.run(run_chain(model, [p.hop() for p in peers], ids, greedy))
        assert ours[: len(ref)] == ref
    finally:
        for p in peers:
            p.stop()
