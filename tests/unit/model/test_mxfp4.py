"""MXFP4 experts (GPT-OSS's official checkpoints): the dequantizer against transformers' own, and a
tiny MXFP4-stored checkpoint loaded by a shard to the weights transformers' loader produces."""

from __future__ import annotations

import json

import pytest
import torch

from p2pserve.model.mxfp4 import dequantize_mxfp4, dequantize_state, quantize_mxfp4
from p2pserve.model.shard import Shard
from p2pserve.model.spec import load_spec
from p2pserve.model.tiny_families import build_family_model


def _random_packed(gen: torch.Generator, shape=(3, 40, 4)) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [E, R, G, 16] of every code pair and scales [E, R, G] around 2**0 (bias 127)."""
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(117, 137, shape, generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_dequantization_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_packed(torch.Generator().manual_seed(0))
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, G * 32, R]
    got = dequantize_mxfp4(blocks, scales, torch.float32)
    assert got.shape == (3, 4 * 32, 40) and torch.equal(got, want)
    torch.testing.assert_close(dequantize_mxfp4(blocks, scales, torch.bfloat16),
                               convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16), rtol=0, atol=0)


def test_quantizing_representable_weights_is_lossless_and_rounds_others_to_the_grid():
    blocks, scales = _random_packed(torch.Generator().manual_seed(1))
    w = dequantize_mxfp4(blocks, scales)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(w)), w)  # every value of the format survives
    x = 0.1 * torch.randn(2, 64, 24, generator=torch.Generator().manual_seed(2))
    y = dequantize_mxfp4(*quantize_mxfp4(x))
    peak = x.transpose(1, 2).reshape(2, 24, 2, 32).abs().amax(-1)  # [E, R, G] per-block max
    # The scale is under peak / 3 and the widest step of the grid (4 to 6) is 2 scales: half a step at most.
    assert ((y - x).abs().transpose(1, 2).reshape(2, 24, 2, 32) <= peak[..., None] / 3).all()


def test_blocks_without_scales_are_refused():
    with pytest.raises(ValueError, match="no .*_scales"):
        dequantize_state({"mlp.experts.down_proj_blocks": torch.zeros(1, 2, 1, 16, dtype=torch.uint8)}, torch.float32)


def test_an_mxfp4_checkpoint_loads_to_the_weights_transformers_dequantizes(tmp_path):
    from transformers import AutoModelForCausalLM

    path = str(build_family_model("gpt-oss", tmp_path / "gpt-oss-mxfp4", seed=0, mxfp4=True))
    names = json.loads(open(f"{path}/model.safetensors.index.json").read())["weight_map"]
    assert "model.layers.4.mlp.experts.gate_up_proj_blocks" in names and "model.layers.4.mlp.experts.down_proj_scales" in names
    assert json.loads(open(f"{path}/config.json").read())["quantization_config"]["quant_method"] == "mxfp4"
    spec = load_spec(path)
    shard = Shard.load(path, spec, 3, spec.num_layers)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # dequantizes on CPU
    mine = dict(shard.layers.named_parameters())
    theirs = dict(ref.model.layers[3:].named_parameters())
    assert mine.keys() == theirs.keys()
    for name, t in theirs.items():
        assert torch.equal(mine[name], t.float()), name
