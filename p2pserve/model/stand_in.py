"""A stand-in shard: the real layer modules of a range, with random weights instead of the
checkpoint's.

A peer times its device on a shard of the model's first layers (``peer/profiler.py``). When its
weights come from the hub, reading those layers would download files the peer may never serve;
the time of a forward does not depend on the weights' values, so the profile is taken on this
stand-in instead, of the same shapes, dtype, device and quantization.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig

from p2pserve.model.quant import quantize_layers
from p2pserve.model.shard import TORCH_DTYPES, Shard
from p2pserve.model.spec import ModelSpec


def stand_in_shard(model_path: str, spec: ModelSpec, start: int, end: int, device: str = "cpu", seed: int = 0) -> Shard:
    """Layers [start, end) of ``spec``'s model as ``Shard.load`` builds them, weights drawn at
    random (std 0.02, seeded): only ``config.json`` is read."""
    hf_config = AutoConfig.from_pretrained(model_path)
    hf_config._attn_implementation = "sdpa"
    shard = Shard(spec, hf_config, start, end)
    dtype = TORCH_DTYPES[spec.dtype]
    gen = torch.Generator().manual_seed(seed)
    state = {name: (torch.randn(p.shape, generator=gen) * 0.02).to(dtype)
             for name, p in shard.named_parameters() if p.is_meta}
    if shard.lm_head is not None and "lm_head.weight" not in state:
        state["lm_head.weight"] = (torch.randn(shard.lm_head.weight.shape, generator=gen) * 0.02).to(dtype)
    shard.load_state_dict(state, strict=False, assign=True)
    for name, buf in list(shard.named_buffers()):
        if buf.is_meta:  # none in the known families; a zero buffer keeps a new one runnable
            owner = shard.get_submodule(name.rpartition(".")[0]) if "." in name else shard
            owner.register_buffer(name.rpartition(".")[2], torch.zeros(buf.shape, dtype=buf.dtype))
    shard.rotary.to(dtype=torch.float32)
    shard.to(device)
    shard.device = torch.device(device)
    quantize_layers(shard.layers, spec.quant)
    return shard.eval()
