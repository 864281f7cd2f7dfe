"""A quantized route through real peer processes is token-identical to the same quantization run
in one process, and a client that did not ask for that quantization cannot use those peers."""

from __future__ import annotations

import asyncio

import pytest

from p2pserve.client.model_info import LocalModelInfo
from p2pserve.client.params import GenerationParams
from p2pserve.errors import GenerationFailedError, ModelMismatchError
from p2pserve.model.quant import quantize_layers
from tests.harness import run_chain, start_peers

pytestmark = pytest.mark.integration
pytest.importorskip("torchao", reason="the 'quant' extra is not installed")

GREEDY = GenerationParams(max_new_tokens=16, ignore_eos=True)


def quantized_reference(path: str, prompt_ids: list[int], quant: str) -> list[int]:
    """Greedy tokens of transformers ``generate`` on the whole model, its decoder layers
    quantized in-process by the same function the peers use."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    quantize_layers(model.model.layers, quant)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def test_int8_route_through_two_peers_matches_in_process_int8(model_dir):
    path = model_dir("llama")
    peers = start_peers(path, [(0, 4), (4, 8)], "--quant", "int8")
    try:
        model = LocalModelInfo.load(path, quant="int8")
        assert model.spec.model_id.endswith("@int8")
        ids = model.chat_ids([{"role": "user", "content": "Quantized weights, served across two peers."}])
        ref = quantized_reference(path, ids, "int8")
        ours = asyncio.run(run_chain(model, [p.hop() for p in peers], ids, GREEDY))
        assert ours[: len(ref)] == ref
        # the same peers refuse a session for the full-width model: quantizations never mix
        with pytest.raises((ModelMismatchError, GenerationFailedError), match="serves model .*@int8"):
            asyncio.run(run_chain(LocalModelInfo.load(path), [p.hop() for p in peers], ids, GREEDY))
    finally:
        for p in peers:
            p.stop()
