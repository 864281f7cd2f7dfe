"""A shard: decoder layers [start, end) of a checkpoint, run as one batch over many sequences.

The shard reuses transformers' own layer modules (projections, norms, MLP, rotary tables),
so the weights and their math are exactly those of `generate`; only attention is driven here,
because continuous batching needs one matmul over the tokens of many sessions while each
session attends to its own KV cache.

Tensor shapes in comments: T = tokens in the batch, H = hidden size, D = head dim,
nH / nKV = query / key-value heads, c = cached tokens before this step.

Fast path. A decode step is one token per sequence, so with small models nearly all of its time
is fixed per-op cost (dispatch, ``nn.Module.__call__``), not arithmetic. For the families whose
layer math is known (`FAST_FAMILIES`) the shard therefore runs the very same tensor ops that
the transformers modules run, in the same order, but called directly: norms as their own ops,
projections as the ``mm``/``addmm`` that ``F.linear`` dispatches to on 2-D inputs, SiLU as
``F.silu``. Rotary tables are computed by the model's own rotary module once for a range of
positions and then sliced, and ``rotate_half(x) * sin`` is computed as ``roll(x) * sin'`` with
the sign of sin's first half flipped, which is exact because IEEE negation commutes with
rounding. Results are bit-identical to the module path (see tests/unit/model/test_shard_fastpath.py).
Anything the fast path does not recognise falls back to calling the modules.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
import torch
import torch.nn.functional as F
from transformers import AutoConfig

from p2pserve.dtypes import MODEL_DTYPES
from p2pserve.errors import BadRequestError
from p2pserve.model.attention import LayerCache, PagedBatch, attend_each, paged_batch
from p2pserve.model.checkpoint import CheckpointIndex
from p2pserve.model.experts import MOE_FAMILIES, fuse_layer_tensors, mlp_of
from p2pserve.model import decode_attention
from p2pserve.model.fast_ops import LayerPlan, Norm, build_layer_plans, gated_mlp, linear, qkv_of, rms_norm, rope
from p2pserve.model.latent_attention import expander, is_latent_attention, latent_qkv
from p2pserve.model.quant import quantize_layers
from p2pserve.model.rotary import is_dynamic_rope, rotary_rows
from p2pserve.model.mxfp4 import dequantize_state
from p2pserve.model.spec import HALF_TABLE_ROPE_FAMILIES, SUPPORTED_FAMILIES, ModelSpec

log = logging.getLogger(__name__)

TORCH_DTYPES = {name: getattr(torch, name) for name in MODEL_DTYPES}


@dataclass
class Segment:
    """n consecutive tokens of one sequence, run through layers [start, end) of this shard.

    ``inputs`` is token ids [n] when start == 0, else hidden states [n, H].
    ``position`` is the absolute position of the first token. When ``want_logits`` is set and
    the span ends at the model's last layer, the result is the last token's logits [V], or the
    last ``logit_rows`` tokens' logits [logit_rows, V] when that is above 1 (speculative
    verification).
    ``rope_end`` is the end position of the whole request this segment is a chunk of (None: its
    own end): rotary types that depend on the sequence length (Phi-3's longrope) pick their
    frequencies from it, as transformers does from the whole forward call's positions.
    """

    inputs: torch.Tensor
    position: int
    start: int
    end: int
    cache: LayerCache
    want_logits: bool = False
    hidden: torch.Tensor | None = field(default=None, repr=False)
    logit_rows: int = 1
    rope_end: int | None = None

    @property
    def n(self) -> int:
        return int(self.inputs.shape[0])


# Rotary types that rescale their frequencies with the sequence length (transformers'
# ``dynamic_rope_update``): their cos/sin are computed every step. Every other type's cos/sin of
# a position never change, so they are computed once into a table and sliced.
_ROPE_TABLE_MIN = 256  # positions computed at once when the rotary table first grows



def split_logits(segments: list[Segment], wanting: list[int], logits: torch.Tensor,
                 outputs: list[torch.Tensor]) -> None:
    """Hand each wanting segment its rows of ``logits`` [sum rows, V], in order: [V] for one
    row, [rows, V] for several (speculative verification)."""
    row = 0
    for i in wanting:
        rows = segments[i].logit_rows
        outputs[i] = logits[row] if rows == 1 else logits[row:row + rows]
        row += rows

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
        self._fast_classes = (norm_cls, getattr(mod, f"{prefix}Attention", None), getattr(mod, f"{prefix}MLP", None),
                              getattr(mod, f"{prefix}SparseMoeBlock", None) or getattr(mod, f"{prefix}MoE", None))
        # Fast-path state, built on first use and dropped whenever weights may have moved.
        self._plan: list[LayerPlan] | None = None
        self._plan_built = False
        self._head: tuple[Norm, torch.Tensor, torch.Tensor | None] | None = None
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._dynamic_rope = is_dynamic_rope(self.rotary)
        self._half_table = spec.family in HALF_TABLE_ROPE_FAMILIES  # one cos/sin per frequency
        self._paged: PagedBatch | None = None  # this step's batched attention, while one runs
        self._compiled = None  # CompiledLayers once ``enable_compile`` ran (model/compiled_step.py)
        self.pack_weights = True  # CPU bf16 projections packed for oneDNN (model/packed_linear.py)

    def _sliding_window(self, layer: int) -> int | None:
        cfg = self.hf_config
        window = getattr(cfg, "sliding_window", None)
        if not window:
            return None
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is not None:
            return window if layer_types[layer] == "sliding_attention" else None
        # Mistral and Phi-3 mask every layer with the model's one window (their models build one
        # sliding-window mask for all layers).
        if self.spec.family in ("mistral", "phi3") or getattr(cfg, "use_sliding_window", False):
            return window
        return None

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, model_path: str, spec: ModelSpec, start: int, end: int, device: str = "cpu") -> "Shard":
        """Read only this shard's tensors from the checkpoint and build the shard."""
        hf_config = AutoConfig.from_pretrained(model_path)
        hf_config._attn_implementation = "sdpa"
        if spec.family in MOE_FAMILIES:
            # What `from_pretrained` picks for these families, so experts run as in `generate`.
            hf_config._experts_implementation = "grouped_mm"
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
        state = dequantize_state({wanted[k]: v for k, v in tensors.items()}, dtype)  # MXFP4 experts
        if spec.family in MOE_FAMILIES:  # per-expert checkpoint matrices -> the module's fused 3-D form
            for i in range(end - start):
                prefix = f"layers.{i}."
                mine = {k[len(prefix):]: state.pop(k) for k in [k for k in state if k.startswith(prefix)]}
                state.update({prefix + k: v for k, v in fuse_layer_tensors(spec.family, mine).items()})
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
        quantize_layers(shard.layers, spec.quant)  # weight-only, when the spec says so (model/quant.py)
        return shard.eval()

    def state_dict_keys(self) -> list[str]:
        """Names of parameters (not buffers) the shard needs from a checkpoint."""
        return [name for name, _ in self.named_parameters()]

    # ------------------------------------------------------------------ fast-path state
    def _reset_fast_path(self) -> None:
        """Forget the plan and rotary table: they hold views of weights and buffers."""
        self._plan, self._plan_built, self._head, self._rope_table = None, False, None, None
        self._compiled = None

    def _apply(self, fn, *args, **kwargs):  # .to(), .half(), .cuda(), ... replace tensors
        self._reset_fast_path()
        return super()._apply(fn, *args, **kwargs)

    def load_state_dict(self, *args, **kwargs):  # assign=True replaces parameters
        self._reset_fast_path()
        return super().load_state_dict(*args, **kwargs)

    def enable_compile(self, buckets: tuple[int, ...] | None = None, warm: bool = True,
                       backend: str = "inductor") -> bool:
        """Run the fast path's dense parts compiled per batch bucket (model/compiled_step.py) by
        torch.compile's ``backend``, compiling every bucket now when ``warm``; False (nothing
        changes) where the fast path does not apply."""
        from p2pserve.model.compiled_step import DEFAULT_BUCKETS, CompiledLayers

        self._reset_fast_path()
        self.pack_weights = False  # compiled graphs take plain weight tensors
        if self._fast_plan() is None:
            return False
        self._compiled = CompiledLayers(self, buckets or DEFAULT_BUCKETS, backend)
        if warm:
            self._compiled.warm(TORCH_DTYPES[self.spec.dtype])
        return True

    def warm(self) -> None:
        """Compile what batched steps run compiled (model/decode_attention.py), on this thread."""
        decode_attention.warm(TORCH_DTYPES[self.spec.dtype], self.spec.num_heads, self.spec.kv_layout, self.device)

    def _fast_plan(self) -> list[LayerPlan] | None:
        if not self._plan_built:
            (self._head, self._plan), self._plan_built = build_layer_plans(self, self.pack_weights), True
        return self._plan

    def _rope_rows(self, segments: list[Segment], like: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin_signed) [n, 1, D] for each segment's positions, in ``like``'s dtype.

        sin_signed is sin with its first half negated (see `rope`). For static rotary types
        the rows are slices of a table that the rotary module computed for positions
        [0, P): each position's row is an elementwise function of that position alone, so it
        is the same whether computed alone or in a batch.
        """
        if self._dynamic_rope:
            # Per segment: these types choose frequencies from the largest position they are
            # given, so one call over a batch would let one session's length change another's.
            # The position row [rope_end - 1] joins the call (and is dropped) so a chunk of a
            # longer request picks what the whole request would.
            rows = []
            for s in segments:
                end = max(s.rope_end or 0, s.position + s.n)
                positions = torch.arange(s.position, s.position + s.n)
                if end > s.position + s.n:
                    positions = torch.cat((positions, torch.tensor([end - 1])))
                cos, sin = rotary_rows(self.rotary, positions.to(self.device), like, self._half_table)
                rows.append((cos[: s.n], sin[: s.n]))
            return rows
        need = max(s.position + s.n for s in segments)
        table = self._rope_table
        if table is None or table[0].shape[0] < need or table[0].dtype != like.dtype:
            size = max(need, _ROPE_TABLE_MIN, 2 * table[0].shape[0] if table is not None else 0)
            table = self._rope_table = rotary_rows(self.rotary, torch.arange(size, device=self.device), like,
                                                   self._half_table)
        cos, sin = table
        return [(cos[s.position : s.position + s.n], sin[s.position : s.position + s.n]) for s in segments]

    # ------------------------------------------------------------------ compute
    @torch.inference_mode()
    def forward_batch(self, segments: list[Segment]) -> list[torch.Tensor]:
        """Run every segment through its span; returns hidden [n, H] or logits [V] per segment."""
        dtype = TORCH_DTYPES[self.spec.dtype]
        plan = self._fast_plan()
        for seg in segments:
            inputs = seg.inputs
            if inputs.device != self.device:
                inputs = inputs.to(self.device, non_blocking=True)
            if seg.start == 0:
                seg.hidden = F.embedding(inputs, self.embed_tokens.weight)
            else:
                seg.hidden = inputs if inputs.dtype == dtype else inputs.to(dtype)
        # Rotary rows of every segment, computed once per step.
        rope = self._rope_rows(segments, segments[0].hidden)
        layer = self._layer if plan is None else self._layer_fast if self._compiled is None else self._compiled.layer
        if len(segments) == 1:  # every decode step of a lone session: no bookkeeping
            seg = segments[0]
            cos, sin = rope[0]
            x = seg.hidden
            for layer_idx in range(seg.start, seg.end):
                x = layer(layer_idx, x, cos, sin, segments)
            seg.hidden = x
        else:
            self._paged = paged_batch(segments)
            try:
                self._run_layers(segments, rope, layer)
            finally:
                self._paged = None
        outputs: list[torch.Tensor] = [seg.hidden for seg in segments]
        wanting = [i for i, seg in enumerate(segments) if seg.want_logits]
        if wanting:
            if self.lm_head is None or any(segments[i].end != self.spec.num_layers for i in wanting):
                raise BadRequestError("logits requested from a span that does not end at the last layer")
            # One head matmul for every sequence's last token: the vocabulary projection is the
            # largest matrix of small models, so doing it per sequence would dominate decode.
            last = torch.cat([segments[i].hidden[-segments[i].logit_rows:] for i in wanting])  # [sum rows, H]
            if self._head is not None:
                norm, head_t, head_bias = self._head
                logits = linear(rms_norm(last, norm), head_t, head_bias)
            else:
                logits = self.lm_head(self.norm(last))
            if logits.dtype != torch.float32:
                logits = logits.float()
            split_logits(segments, wanting, logits.cpu(), outputs)
        return outputs

    def _run_layers(self, segments: list[Segment], rope, layer) -> None:
        """Run several segments layer by layer, each layer over the segments whose span has it."""
        lo = min(s.start for s in segments)
        hi = max(s.end for s in segments)
        previous_active: list[int] | None = None
        cos = sin = None
        active_segments: list[Segment] = []
        for layer_idx in range(lo, hi):
            active = [i for i, s in enumerate(segments) if s.start <= layer_idx < s.end]
            if not active:
                continue
            if active != previous_active:
                if len(active) == 1:
                    cos, sin = rope[active[0]]
                else:
                    cos = torch.cat([rope[i][0] for i in active])
                    sin = torch.cat([rope[i][1] for i in active])
                active_segments = [segments[i] for i in active]
                previous_active = active
            if len(active) == 1:
                active_segments[0].hidden = layer(layer_idx, active_segments[0].hidden, cos, sin, active_segments)
                continue
            x = layer(layer_idx, torch.cat([s.hidden for s in active_segments]), cos, sin, active_segments)
            at = 0
            for s in active_segments:
                s.hidden = x[at : at + s.n]
                at += s.n

    def _layer(self, layer_idx: int, x: torch.Tensor, cos, sin, segments: list[Segment]) -> torch.Tensor:
        """One decoder layer through the transformers modules (any family)."""
        layer = self.layers[layer_idx - self.start]
        attn = layer.self_attn
        T = x.shape[0]
        D = self.spec.head_dim
        h = layer.input_layernorm(x)
        expand = None
        if is_latent_attention(attn):  # DeepSeek-V3: its cache holds a latent (model/latent_attention.py)
            q, k, v = latent_qkv(attn, h, cos, sin)  # [T, nH, qk] (rotated), latent [T, 1, r], rotary key [T, 1, R]
            expand = expander(attn)
        elif hasattr(attn, "qkv_proj"):  # Phi-3: one fused [H, (nH + 2 nKV) D] projection
            q_size, kv_size = self.spec.num_heads * D, self.spec.num_kv_heads * D
            q, k, v = attn.qkv_proj(h).split((q_size, kv_size, kv_size), dim=-1)
            q, k, v = q.reshape(T, -1, D), k.reshape(T, -1, D), v.reshape(T, -1, D)
        else:
            q = attn.q_proj(h).view(T, -1, D)  # [T, nH, D]
            k = attn.k_proj(h).view(T, -1, D)  # [T, nKV, D]
            v = attn.v_proj(h).view(T, -1, D)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        if expand is None:
            q, k = rope(q, k, cos, sin)
        o = self._attention(layer_idx, q, k, v, segments, attn.scaling, expand)
        x = x + attn.o_proj(o)
        return x + mlp_of(layer.mlp, layer.post_attention_layernorm(x))

    def _layer_fast(self, layer_idx: int, x: torch.Tensor, cos, sin, segments: list[Segment]) -> torch.Tensor:
        """`_layer` for the known families with the module wrappers peeled off: same ops, same order."""
        p = self._plan[layer_idx - self.start]
        spec = self.spec
        D = spec.head_dim
        h = rms_norm(x, p.input_norm)
        q, k, v = qkv_of(h, p, spec.num_heads * D, spec.num_kv_heads * D, D)  # [T, nH | nKV, D]
        if p.q_norm is not None:  # Qwen3: per-head RMSNorm before RoPE
            q, k = rms_norm(q, p.q_norm), rms_norm(k, p.k_norm)
        q, k = rope(q, k, cos, sin)
        o = self._attention(layer_idx, q, k, v, segments, p.scaling)
        # In-place ops below only touch tensors made in this call (never the input x), and
        # a + b == b + a, a * b == b * a bit for bit.
        x = linear(o, *p.o).add_(x)  # x + o_proj(o)
        return x.add_(gated_mlp(rms_norm(x, p.post_norm), p))  # x + down(act(gate(h)) * up(h))

    def _attention(self, layer_idx: int, q, k, v, segments: list[Segment], scaling: float, expand=None):
        """Append k, v to each segment's cache and attend; q, k, v [T, heads, D] -> [T, nH * Dv]
        (``expand``: latent attention's cached rows -> per-head keys and values)."""
        window = self.windows[layer_idx - self.start]
        sinks = getattr(self.layers[layer_idx - self.start].self_attn, "sinks", None)  # [nH] (GPT-OSS)
        if self._paged is not None:
            return self._paged.attend(layer_idx, q, k, v, scaling, window, sinks, expand)
        return attend_each(layer_idx, q, k, v, segments, scaling, window, sinks, expand)

