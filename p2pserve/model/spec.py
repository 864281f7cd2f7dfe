"""Model specs: the shape facts about a checkpoint that routing, planning and the wire need.

A `ModelSpec` is read from a Hugging Face `config.json` without importing torch or building
the model, so the coordinator and the client can reason about a model they never load.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from p2pserve.dtypes import DTYPE_SIZES, MODEL_DTYPES
from p2pserve.errors import UnknownModelError, UnsupportedModelError
from p2pserve.model.checkpoint_id import checkpoint_id
from p2pserve.model.experts import expert_shape
from p2pserve.model.latent_attention import LatentShape, latent_shape
from p2pserve.model.quant import BYTES_PER_WEIGHT, check_quant, with_quant

# model_type -> (transformers module, class-name prefix). These families share the Llama
# decoder layout (pre-norm, RoPE, GQA, gated MLP); Qwen2 adds q/k/v biases, Qwen3 per-head q/k
# RMSNorm, Mistral a sliding window, and Phi-3 fuses q/k/v and gate/up into one matrix each.
# Qwen3-MoE (Qwen3's attention) and Mixtral (Mistral's) replace the MLP by routed experts
# (model/experts.py); GLM-4.5 adds a shared expert to its routed ones, q/k/v biases and partial
# rotary. GPT-OSS adds attention sinks, q/k/v/o biases, alternating sliding-window and full
# layers, YaRN rope and biased experts (MXFP4 in its official checkpoints, model/mxfp4.py).
# DeepSeek-V3 has multi-head latent attention (model/latent_attention.py: its cache is one
# compressed latent per token) and GLM-4.5's kind of routing, in groups.
# docs/models.md says what each family's checkpoints look like and what the tests prove.
SUPPORTED_FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("transformers.models.llama.modeling_llama", "Llama"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "Mistral"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3"),
    "phi3": ("transformers.models.phi3.modeling_phi3", "Phi3"),
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3Moe"),
    "mixtral": ("transformers.models.mixtral.modeling_mixtral", "Mixtral"),
    "glm4_moe": ("transformers.models.glm4_moe.modeling_glm4_moe", "Glm4Moe"),
    "gpt_oss": ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOss"),
    "deepseek_v3": ("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3"),
}
# Families whose attention rotates only part of each head (``partial_rotary_factor`` < 1), as the
# shard's `rope` reproduces: GLM-4.5 rotates the first half of each 128-wide head.
PARTIAL_ROTARY_FAMILIES = frozenset({"glm4_moe"})
# Families whose rotary module returns one cos/sin per frequency ([.., D/2]) and turns both halves
# of each head by them (GPT-OSS), where the others return the table already doubled ([.., D]).
HALF_TABLE_ROPE_FAMILIES = frozenset({"gpt_oss"})



@dataclass(frozen=True)
class ModelSpec:
    """Shape facts of a decoder-only checkpoint.

    ``model_id`` names the weights by their content (family plus a digest of config.json and the
    weight files, ``model/checkpoint_id.py``), so that peers serving different checkpoints never
    mix in one pipeline and copies of one checkpoint (a hub id, a local folder) meet; with
    weight-only quantization (``quant``, ``model/quant.py``) it ends in ``@SCHEME``, so that
    quantized and full-width weights never mix either.
    """

    model_id: str
    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype: str
    tie_word_embeddings: bool
    max_position_embeddings: int
    # Phi-3 longrope: rotary factors switch from short to long once a sequence is longer than
    # this, and transformers then recomputes the whole cache (the client re-sends the history).
    recompute_past: int | None = None
    quant: str | None = None  # weight-only scheme of the decoder layers (int8, nf4, int4) or None
    # Routed experts (0 for dense models): E experts of width expert_intermediate_size per routed
    # layer, experts_per_token of them run per token; moe_layers of the num_layers are routed.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    moe_layers: int = 0
    shared_expert_intermediate_size: int = 0  # shared experts every token runs in routed layers (GLM-4.5)
    latent: LatentShape | None = None  # multi-head latent attention's widths (DeepSeek-V3), else None

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the compute dtype."""
        return DTYPE_SIZES[self.dtype]

    @property
    def activation_bytes_per_token(self) -> int:
        """Bytes one token's hidden state takes on the wire between two peers."""
        return self.hidden_size * self.dtype_bytes

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """(heads, K width, V width) of one token's row in one layer's cache: nKV, D, D; with
        latent attention one "head" of the compressed latent (kv_lora_rank) as K and the shared
        rotary key (qk_rope_head_dim) as V."""
        if self.latent is not None:
            return 1, self.latent.kv_lora_rank, self.latent.qk_rope_head_dim
        return self.num_kv_heads, self.head_dim, self.head_dim

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """Bytes one token occupies in one layer's cache: K and V, or the latent and rotary key."""
        heads, k, v = self.kv_layout
        return heads * (k + v) * self.dtype_bytes

    def _layer_params(self, experts: int) -> int:
        """Weights of an average layer when ``experts`` experts of each routed layer count."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * self.num_heads * self.head_dim * 2 + h * kv * 2
        if self.latent is not None:
            attn = self.latent.attention_params(h, self.num_heads)
        dense = 3 * h * self.intermediate_size
        if not self.num_experts:
            return attn + dense
        routed = (self.num_experts * h + experts * 3 * h * self.expert_intermediate_size  # router + experts
                  + 3 * h * self.shared_expert_intermediate_size)
        mlp = (self.moe_layers * routed + (self.num_layers - self.moe_layers) * dense) // self.num_layers
        return attn + mlp

    @property
    def layer_param_count(self) -> int:
        """Parameters one decoder layer holds in memory (weights only; biases and norms are
        negligible): with routed experts, all of them, averaged over the model's layers."""
        return self._layer_params(self.num_experts)

    @property
    def layer_active_param_count(self) -> int:
        """Parameters one token's pass through a layer multiplies by: with routed experts, only
        the ``experts_per_token`` it is routed to (plus the router), so far below
        `layer_param_count`; for dense models the same."""
        return self._layer_params(self.experts_per_token)

    @property
    def layer_bytes(self) -> int:
        """Bytes one decoder layer's weights take: in the compute dtype, or quantized (``quant``)."""
        per_weight = BYTES_PER_WEIGHT[self.quant] if self.quant else self.dtype_bytes
        return int(self.layer_param_count * per_weight)


def _config_path(model_path: str | os.PathLike) -> Path:
    path = Path(model_path).expanduser()
    if not path.is_dir() or not (path / "config.json").is_file():
        raise UnknownModelError(
            f"model {str(model_path)!r} does not exist: expected a directory with config.json "
            "and *.safetensors (run `p2pserve prepare-model` for the embedded default)"
        )
    return path / "config.json"


def load_spec(model_path: str | os.PathLike, dtype: str | None = None, quant: str | None = None) -> ModelSpec:
    """Read a ModelSpec from a checkpoint directory (its layers served at ``quant``); raises
    UnknownModelError if unusable, ConfigError if ``quant`` cannot run here."""
    cfg_file = _config_path(model_path)
    cfg = json.loads(cfg_file.read_bytes())
    family = check_supported(cfg, model_path)
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    dtype = dtype or "float32"
    if dtype not in MODEL_DTYPES:
        raise UnknownModelError(f"unsupported dtype {dtype!r}; use one of {sorted(MODEL_DTYPES)}")
    num_layers = int(cfg["num_hidden_layers"])
    experts = expert_shape(cfg, num_layers)
    return ModelSpec(
        model_id=with_quant(checkpoint_id(cfg_file.parent, family), check_quant(quant)),
        family=family,
        num_layers=num_layers,
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        dtype=dtype,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        recompute_past=_longrope_switch(cfg),
        quant=check_quant(quant),
        num_experts=experts.num_experts if experts else 0,
        experts_per_token=experts.experts_per_token if experts else 0,
        expert_intermediate_size=experts.expert_intermediate_size if experts else 0,
        moe_layers=experts.moe_layers if experts else 0,
        shared_expert_intermediate_size=experts.shared_intermediate_size if experts else 0,
        latent=latent_shape(cfg),
    )


def _longrope_switch(cfg: dict) -> int | None:
    """Phi-3's ``original_max_position_embeddings`` when its rope type is longrope ("su" in the
    first releases), else None."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if kind not in ("longrope", "su"):
        return None
    original = rope.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    return int(original) if original else None


def check_supported(cfg: dict, model_path: str | os.PathLike = "") -> str:
    """The family (``model_type``) of a parsed config.json, or `UnsupportedModelError` naming it.

    Beyond the family, a feature the shard's attention does not reproduce is refused here too,
    so a peer and a client fail at start with the reason instead of serving wrong tokens:
    partial rotary embeddings (Phi-4-mini's ``partial_rotary_factor`` 0.75), block-FP8 weights.
    """
    family = cfg.get("model_type")
    where = f" at {model_path}" if str(model_path) else ""
    if family not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"model family {family!r}{where} is not supported (config.json model_type); "
            f"supported families: {', '.join(sorted(SUPPORTED_FAMILIES))}",
            family=family if isinstance(family, str) else None,
        )
    quant = cfg.get("quantization_config") or {}
    if isinstance(quant, dict) and quant.get("quant_method") == "fp8":  # DeepSeek-V3's hub checkpoint
        raise UnsupportedModelError(
            f"model family {family!r}{where}: block-FP8 checkpoints (quantization_config fp8) are not "
            "dequantized; serve a bf16 conversion of it", family=family,
        )
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0) if isinstance(rope, dict) else 1.0)
    if partial not in (None, 1, 1.0) and family not in PARTIAL_ROTARY_FAMILIES:
        raise UnsupportedModelError(
            f"model family {family!r}{where}: partial rotary embeddings (partial_rotary_factor={partial}) "
            "are not supported", family=family,
        )
    return family
