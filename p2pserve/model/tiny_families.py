"""Tiny random models shaped like real checkpoints, saved as the hub saves them.

`build_family_model` takes a real config.json (`family_configs.FAMILIES`), scales hidden size,
layers and vocabulary down and keeps what makes the family itself: the rope settings (type,
theta, scaling factors), head_dim, the GQA ratio, biases, norms and tie flags. The folder it
writes is a standard Hugging Face one: safetensors split into several shards with
``model.safetensors.index.json``, a hub-format ``config.json`` (``rope_scaling``, ``torch_dtype``),
``generation_config.json`` with the family's end-of-reply ids, and a tokenizer with the
family's special tokens and chat template. Weights are seeded, std 0.1 (norms 1 ± 0.1), so
greedy argmax gaps are wide and exactness tests check the pipeline, not float noise.

Context lengths that decide behaviour within a few dozen tokens are scaled by the same factor
(``_CONTEXT_SCALE``): Phi-3.5's longrope switch at 4096 positions happens at 64, Phi-3-mini-4k's
window of 2047 becomes 31, and Mistral gets v0.1's 4096 window as 64 (v0.3 has none).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from p2pserve.model.family_configs import DEEPSEEK_V3, FAMILIES, MISTRAL_V0_1_SLIDING_WINDOW
from p2pserve.model.mxfp4 import quantize_mxfp4
from p2pserve.model.shard import TORCH_DTYPES
from p2pserve.model.tiny import build_tokenizer, randomize_weights

TINY_FAMILY_NAMES = tuple(FAMILIES)
_CONTEXT_SCALE = 64  # 4096 real positions -> 64 tiny ones

# Per family: the shape fields that shrink (heads keep head_dim and the real GQA ratio).
_SHAPES: dict[str, dict] = {
    "llama3": dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=1),
    "qwen2.5": dict(hidden_size=448, intermediate_size=1216, num_attention_heads=7, num_key_value_heads=1,
                    max_window_layers=5),
    "qwen3": dict(hidden_size=128, intermediate_size=384, num_attention_heads=2, num_key_value_heads=1,
                  max_window_layers=6),
    "mistral": dict(hidden_size=512, intermediate_size=1792, num_attention_heads=4, num_key_value_heads=1,
                    sliding_window=MISTRAL_V0_1_SLIDING_WINDOW // _CONTEXT_SCALE),
    "phi3.5": dict(hidden_size=192, intermediate_size=512, num_attention_heads=2, num_key_value_heads=2,
                   max_position_embeddings=131072 // _CONTEXT_SCALE,
                   original_max_position_embeddings=4096 // _CONTEXT_SCALE,
                   sliding_window=262144 // _CONTEXT_SCALE),
    # Only the window shrinks: a session may not outgrow max_position_embeddings.
    "phi3-4k": dict(hidden_size=192, intermediate_size=512, num_attention_heads=2, num_key_value_heads=2,
                    sliding_window=2048 // _CONTEXT_SCALE - 1),
    # Routed experts: 8 per layer, 2 per token (Mixtral's own routing; Qwen3-MoE's 128 / 8 scaled).
    # Qwen3-MoE keeps GQA 8:1 with two KV heads, so tensor parallelism over 2 ranks can split it.
    "qwen3-moe": dict(hidden_size=128, intermediate_size=384, moe_intermediate_size=64, num_experts=8,
                      num_experts_per_tok=2, num_attention_heads=16, num_key_value_heads=2, max_window_layers=6),
    "mixtral": dict(hidden_size=512, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
                    num_local_experts=8, num_experts_per_tok=2),
    # GLM-4.5: GQA 12:1 (96:8) with two KV heads, so tensor parallelism over 2 ranks can split it; one
    # dense layer before the routed ones (3 of 92 in the real one).
    "glm4.5": dict(hidden_size=256, intermediate_size=384, moe_intermediate_size=64, n_routed_experts=8,
                   num_experts_per_tok=2, num_attention_heads=24, num_key_value_heads=2, first_k_dense_replace=1),
    # GPT-OSS: GQA 8:1 (64:8), head_dim 64, sinks, YaRN unchanged; the window/full alternation kept
    # and the window scaled by 1/8 (128 -> 16: a 1/64 window of 2 would hide nearly every key).
    "gpt-oss": dict(hidden_size=256, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                    experts_per_token=2, num_attention_heads=8, num_key_value_heads=1, sliding_window=16),
    # DeepSeek-V3: head widths kept (qk 128 + 64, v 128), the latent and q bottleneck scaled with the
    # hidden size (512 -> 128, 1536 -> 192); 8 experts in 4 groups, the best 2 groups, 2 per token;
    # YaRN's original 4096 positions and the context scaled by 1/64 (factor 40 kept).
    "deepseek-v3": dict(hidden_size=256, intermediate_size=384, moe_intermediate_size=64, n_routed_experts=8,
                        num_experts_per_tok=2, n_group=4, topk_group=2, num_attention_heads=4, num_key_value_heads=4,
                        kv_lora_rank=128, q_lora_rank=192, first_k_dense_replace=1,
                        max_position_embeddings=163840 // _CONTEXT_SCALE,
                        rope_scaling=dict(DEEPSEEK_V3["rope_scaling"], original_max_position_embeddings=4096 // _CONTEXT_SCALE)),
}
# Families whose router adds a learned correction bias to its scores before choosing (a buffer the
# seeded parameter draw does not reach): drawn too, so the tests route as a trained model would.
_ROUTER_BIAS = frozenset({"deepseek-v3"})


def family_tokenizer(family: str):
    """The tiny byte-level BPE tokenizer with ``family``'s special tokens and chat template."""
    f = FAMILIES[family]
    specials = tuple(dict.fromkeys(f["tokens"].values()))
    return build_tokenizer(special_tokens=specials, bos=f["bos"], eos=f["eos"], pad=f["pad"],
                           chat_template=f["template"])


def family_config(family: str, tokenizer, num_layers: int = 6) -> dict:
    """The real config.json of ``family``, scaled down, with token ids mapped onto ``tokenizer``.

    The vocabulary is the tokenizer's rounded up to a multiple of 64, so (as in Qwen's and
    Phi-3's real checkpoints) the embedding has rows no token uses.
    """
    f = FAMILIES[family]
    cfg = json.loads(json.dumps(f["config"]))  # a deep copy
    cfg.update(_SHAPES[family], num_hidden_layers=num_layers, torch_dtype="float32")
    cfg.pop("quantization_config", None)  # stored unquantized (`build_family_model(mxfp4=True)` for MXFP4)
    if "layer_types" in cfg:  # the real alternation, cut to the tiny depth
        cfg["layer_types"] = [cfg["layer_types"][i % len(cfg["layer_types"])] for i in range(num_layers)]
    cfg["vocab_size"] = -(-len(tokenizer) // 64) * 64
    ids = _id_map(family, tokenizer)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in cfg:
            cfg[key] = _mapped(cfg[key], ids)
    return cfg


def build_family_model(family: str, out_dir: str | Path, seed: int = 0, num_layers: int = 6,
                       dtype: str = "float32", shards: int = 4, mxfp4: bool = False) -> Path:
    """Write a seeded tiny ``family`` model to ``out_dir`` as a sharded hub-style folder.

    ``dtype`` is the stored dtype (float32, bfloat16 or float16): weights are drawn in fp32 and
    cast, as a hub checkpoint stores its training weights rounded. ``shards`` is about how
    many safetensors files the weights are split into. ``mxfp4`` stores the fused experts as MXFP4
    blocks and scales with the real config's ``quantization_config``, as GPT-OSS's official
    checkpoints do (`model/mxfp4.py`). Returns ``out_dir``; an existing folder
    is returned as it is.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; choose from {TINY_FAMILY_NAMES}")
    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    tokenizer = family_tokenizer(family)
    raw = family_config(family, tokenizer, num_layers)
    raw["torch_dtype"] = dtype
    config = AutoConfig.for_model(**raw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed)
    if family in _ROUTER_BIAS:
        _randomize_router_bias(model, seed)
    model.to(TORCH_DTYPES[dtype])
    ids = _id_map(family, tokenizer)
    model.generation_config = GenerationConfig(**{
        k: _mapped(v, ids) if k.endswith("token_id") else v for k, v in FAMILIES[family]["generation"].items()
    })
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, max_shard_size=max(1, total // shards + 1))
    tokenizer.save_pretrained(tmp)
    # The hub's config.json, not transformers' re-serialisation of it: loaders must read the
    # format real checkpoints ship (rope_scaling, rope_theta, torch_dtype).
    if mxfp4:
        _store_experts_mxfp4(tmp)
        raw["quantization_config"] = FAMILIES[family]["config"]["quantization_config"]
    (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    tmp.rename(out)
    return out


def _store_experts_mxfp4(folder: Path) -> None:
    """Rewrite a saved folder's fused expert weights (``experts.gate_up_proj``, ``experts.down_proj``)
    as MXFP4 ``_blocks`` and ``_scales`` tensors, in their files, and the index with them."""
    from safetensors.torch import load_file, save_file

    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    weight_map = index["weight_map"]
    for fname in sorted(set(weight_map.values())):
        tensors, out = load_file(str(folder / fname)), {}
        for name, t in tensors.items():
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                out[name] = t
                continue
            out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(t)
            del weight_map[name]
            weight_map[name + "_blocks"] = weight_map[name + "_scales"] = fname
        save_file(out, str(folder / fname), metadata={"format": "pt"})
    index_file.write_text(json.dumps(index, indent=2) + "\n")


def _id_map(family: str, tokenizer) -> dict[int, int]:
    """Real token id -> the tiny tokenizer's id of the same token text."""
    return {real: tokenizer.convert_tokens_to_ids(text) for real, text in FAMILIES[family]["tokens"].items()}


def _mapped(value, ids: dict[int, int]):
    if isinstance(value, list):
        return [ids[v] for v in value]
    return None if value is None else ids[value]


def _randomize_router_bias(model, seed: int) -> None:
    """Seeded std-0.1 values for every router's ``e_score_correction_bias`` [E]."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
