"""A shard: decoder layers [start, end) of a checkpoint, run as one batch over many sequences.

The shard reuses transformers' own layer modules (projections, norms, MLP, rotary tables),
so the weights and their math are exactly those of `generate`; only attention is driven here,
because continuous batching needs one matmul over the tokens of many sessions while each
session attends to its own KV cache.

Tensor shapes in comments: T = tokens in the batch, H = hidden size, D = head dim,
nH / nKV = query / key-value heads, c = cached tokens before this step.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AutoConfig

from p2pserve.errors import BadRequestError
from p2pserve.model.checkpoint import CheckpointIndex
from p2pserve.model.spec import SUPPORTED_FAMILIES, ModelSpec

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class LayerCache(Protocol):
    """The KV storage of one sequence, as the shard sees it."""

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([nKV, n, D]) after the cached ones; return all keys and values [nKV, c+n, D]."""


@dataclass
class Segment:
    """n consecutive tokens of one sequence, run through layers [start, end) of this shard.

    ``inputs`` is token ids [n] when start == 0, else hidden states [n, H].
    ``position`` is the absolute position of the first token. When ``want_logits`` is set and
    the span ends at the model's last layer, the result is the last token's logits [V].
    """

    inputs: torch.Tensor
    position: int
    start: int
    end: int
    cache: LayerCache
    want_logits: bool = False
    hidden: torch.Tensor | None = field(default=None, repr=False)

    @property
    def n(self) -> int:
        return int(self.inputs.shape[0])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Shard(torch.nn.Module):
    """Layers [start, end) of a model, plus embeddings if start == 0 and head if end == L."""

    def __init__(self, spec: ModelSpec, hf_config, start: int, end: int):
        super().__init__()
        if not (0 <= start < end <= spec.num_layers):
            raise BadRequestError(f"invalid layer range [{start}, {end}) for a {spec.num_layers}-layer model")
        self.spec, self.start, self.end = spec, start, end
        module_name, prefix = SUPPORTED_FAMILIES[spec.family]
        mod = importlib.import_module(module_name)
        layer_cls = getattr(mod, f"{prefix}DecoderLayer")
        norm_cls = getattr(mod, f"{prefix}RMSNorm")
        rotary_cls = getattr(mod, f"{prefix}RotaryEmbedding")
        self.hf_config = hf_config
        # Build on the meta device so no memory is spent on random init; weights are assigned.
        with torch.device("meta"):
            self.layers = torch.nn.ModuleList(layer_cls(hf_config, i) for i in range(start, end))
            self.embed_tokens = (
                torch.nn.Embedding(spec.vocab_size, spec.hidden_size) if start == 0 else None
            )
            if end == spec.num_layers:
                self.norm = norm_cls(spec.hidden_size, eps=hf_config.rms_norm_eps)
                self.lm_head = torch.nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
            else:
                self.norm = self.lm_head = None
        self.rotary = rotary_cls(config=hf_config)
        self.windows = [self._sliding_window(i) for i in range(start, end)]
        self.device = torch.device("cpu")

    def _sliding_window(self, layer: int) -> int | None:
        cfg = self.hf_config
        window = getattr(cfg, "sliding_window", None)
        if not window:
            return None
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is not None:
            return window if layer_types[layer] == "sliding_attention" else None
        if self.spec.family == "mistral" or getattr(cfg, "use_sliding_window", False):
            return window
        return None

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, model_path: str, spec: ModelSpec, start: int, end: int, device: str = "cpu") -> "Shard":
        """Read only this shard's tensors from the checkpoint and build the shard."""
        hf_config = AutoConfig.from_pretrained(model_path)
        hf_config._attn_implementation = "sdpa"
        shard = cls(spec, hf_config, start, end)
        index = CheckpointIndex(model_path)
        dtype = TORCH_DTYPES[spec.dtype]
        wanted: dict[str, str] = {}  # checkpoint name -> our state-dict name
        for i in range(start, end):
            for name in index.names_with_prefix(f"model.layers.{i}."):
                wanted[name] = f"layers.{i - start}." + name[len(f"model.layers.{i}."):]
        if start == 0:
            wanted["model.embed_tokens.weight"] = "embed_tokens.weight"
        if end == spec.num_layers:
            wanted["model.norm.weight"] = "norm.weight"
            if index.has("lm_head.weight"):
                wanted["lm_head.weight"] = "lm_head.weight"
            elif not spec.tie_word_embeddings:
                raise BadRequestError("checkpoint has no lm_head.weight and embeddings are not tied")
        tensors = index.read(list(wanted), dtype)
        state = {wanted[k]: v for k, v in tensors.items()}
        if end == spec.num_layers and "lm_head.weight" not in state:
            # Tied embeddings: the head is the embedding matrix. Read it even when this shard
            # does not hold layer 0.
            emb = state.get("embed_tokens.weight")
            if emb is None:
                emb = index.read(["model.embed_tokens.weight"], dtype)["model.embed_tokens.weight"]
            state["lm_head.weight"] = emb
        missing = set(shard.state_dict_keys()) - set(state)
        if missing:
            raise BadRequestError(f"checkpoint lacks tensors for this shard: {sorted(missing)[:5]}")
        shard.load_state_dict(state, strict=False, assign=True)
        shard.rotary.to(dtype=torch.float32)
        shard.to(device)
        shard.device = torch.device(device)
        shard.eval()
        return shard

    def state_dict_keys(self) -> list[str]:
        """Names of parameters (not buffers) the shard needs from a checkpoint."""
        return [name for name, _ in self.named_parameters()]

    # ------------------------------------------------------------------ compute
    @torch.inference_mode()
    def forward_batch(self, segments: list[Segment]) -> list[torch.Tensor]:
        """Run every segment through its span; returns hidden [n, H] or logits [V] per segment."""
        dtype = TORCH_DTYPES[self.spec.dtype]
        for seg in segments:
            inputs = seg.inputs.to(self.device, non_blocking=True)
            if seg.start == 0:
                seg.hidden = self.embed_tokens(inputs)
            else:
                seg.hidden = inputs.to(dtype)
        lo = min(s.start for s in segments)
        hi = max(s.end for s in segments)
        # Rotary tables for every token in the batch, computed once per step.
        positions = torch.cat([torch.arange(s.position, s.position + s.n) for s in segments]).to(self.device)
        cos_all, sin_all = self.rotary(segments[0].hidden[None], positions[None])
        cos_all, sin_all = cos_all[0], sin_all[0]  # [T, D]
        offsets, acc = [], 0
        for s in segments:
            offsets.append(acc)
            acc += s.n
        previous_active: list[int] | None = None
        cos = sin = None
        for layer_idx in range(lo, hi):
            active = [i for i, s in enumerate(segments) if s.start <= layer_idx < s.end]
            if not active:
                continue
            if active != previous_active:
                if len(active) == len(segments):
                    cos, sin = cos_all, sin_all
                else:
                    rows = torch.cat([torch.arange(offsets[i], offsets[i] + segments[i].n) for i in active])
                    rows = rows.to(self.device)
                    cos, sin = cos_all[rows], sin_all[rows]
                previous_active = active
            x = torch.cat([segments[i].hidden for i in active]) if len(active) > 1 else segments[active[0]].hidden
            x = self._layer(layer_idx, x, cos, sin, [segments[i] for i in active])
            at = 0
            for i in active:
                n = segments[i].n
                segments[i].hidden = x[at : at + n]
                at += n
        outputs: list[torch.Tensor] = [seg.hidden for seg in segments]
        wanting = [i for i, seg in enumerate(segments) if seg.want_logits]
        if wanting:
            if self.lm_head is None or any(segments[i].end != self.spec.num_layers for i in wanting):
                raise BadRequestError("logits requested from a span that does not end at the last layer")
            # One head matmul for every sequence's last token: the vocabulary projection is the
            # largest matrix of small models, so doing it per sequence would dominate decode.
            last = torch.cat([segments[i].hidden[-1:] for i in wanting])  # [S, H]
            logits = self.lm_head(self.norm(last)).float().cpu()  # [S, V]
            for row, i in enumerate(wanting):
                outputs[i] = logits[row]
        return outputs

    def _layer(self, layer_idx: int, x: torch.Tensor, cos, sin, segments: list[Segment]) -> torch.Tensor:
        layer = self.layers[layer_idx - self.start]
        attn = layer.self_attn
        T = x.shape[0]
        D = self.spec.head_dim
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(T, -1, D)  # [T, nH, D]
        k = attn.k_proj(h).view(T, -1, D)  # [T, nKV, D]
        v = attn.v_proj(h).view(T, -1, D)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        c, s = cos[:, None, :].to(q.dtype), sin[:, None, :].to(q.dtype)
        q = q * c + _rotate_half(q) * s
        k = k * c + _rotate_half(k) * s
        window = self.windows[layer_idx - self.start]
        outs = []
        at = 0
        for seg in segments:
            n = seg.n
            qs = q[at : at + n].transpose(0, 1)  # [nH, n, D]
            ks, vs = seg.cache.append(layer_idx, k[at : at + n].transpose(0, 1), v[at : at + n].transpose(0, 1))
            mask = _attention_mask(n, ks.shape[1], window, x.device)
            o = F.scaled_dot_product_attention(
                qs[None], ks[None], vs[None], attn_mask=mask, scale=attn.scaling, enable_gqa=True
            )
            outs.append(o[0].transpose(0, 1).reshape(n, -1))
            at += n
        o = attn.o_proj(torch.cat(outs) if len(outs) > 1 else outs[0])
        x = x + o
        return x + layer.mlp(layer.post_attention_layernorm(x))


def _attention_mask(n: int, total: int, window: int | None, device) -> torch.Tensor | None:
    """Boolean [n, total] mask: query i (absolute total-n+i) sees keys j <= its position.

    A single query token with no window sees the whole cache, so no mask is built for decode.
    """
    past = total - n
    if n == 1 and (window is None or total <= window):
        return None
    q_pos = torch.arange(past, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= (q_pos - k_pos) < window
    return mask
