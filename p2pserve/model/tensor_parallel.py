"""Tensor parallelism: one shard's layers split across the ranks of a torch.distributed group.

Megatron-style split of each decoder layer over ``world`` ranks (rank r of w):

* q/k/v projections by attention heads: rank r holds query heads [r nH/w, (r+1) nH/w) and KV
  heads [r nKV/w, (r+1) nKV/w) (so GQA groups stay whole on one rank), and the KV cache of
  exactly those heads;
* o_proj by its input columns (the same heads), MLP gate/up by output rows, down by input
  columns; each rank's o_proj and down_proj give a partial sum [T, H], and one all-reduce (sum)
  after each makes the full residual update on every rank;
* routed experts (Qwen3-MoE, Mixtral, GLM-4.5) by each expert's MLP width, as a dense MLP is split:
  every rank holds every expert's gate/up rows and down columns of its share, the router is
  replicated (every rank routes the same all-reduced x alike), and the experts' weighted sum is
  the partial sum all-reduced after the MLP; GLM-4.5's shared expert splits by its width too (its
  partial sum joins the experts'), and its dense first layers by theirs;
* norms (and Qwen3's per-head q/k norms) replicated; biases of o_proj/down only on rank 0, so the
  sum adds them once. Embeddings, the final norm and the LM head stay on rank 0 only: the other
  ranks receive hidden states [T, H] that rank 0 embedded.

Every rank runs the same segments in the same order (rank 0 sends each step's layout first,
``tp_comm.py``), so the collectives line up. The split changes the summation order of the o_proj
and down_proj matmuls (two partial dot products added instead of one), so outputs agree with the
unsplit layer within fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref

import torch
import torch.nn.functional as F

from p2pserve.errors import BadRequestError, ConfigError, RequestError
from p2pserve.model.fast_ops import gated_mlp, linear, qkv_of, rms_norm, rope
from p2pserve.model.shard import TORCH_DTYPES, Segment, Shard, split_logits
from p2pserve.model.spec import ModelSpec

_cache_keys = itertools.count(1)


def check_splittable(spec: ModelSpec, world: int) -> None:
    """Raise ConfigError unless ``spec``'s heads and MLP split evenly over ``world`` ranks."""
    if world < 1:
        raise ConfigError(f"tensor-parallel size must be >= 1, got {world}")
    if spec.quant:
        raise ConfigError("tensor parallelism does not combine with --quant")
    if spec.family == "gpt_oss":  # its sinks, o_proj bias and biased experts have no split here yet
        raise ConfigError("tensor parallelism does not split gpt_oss (attention sinks, biased experts) yet")
    if spec.latent is not None:  # its heads share one cached latent: splitting needs its own slicing
        raise ConfigError("tensor parallelism does not split multi-head latent attention (DeepSeek-V3) yet")
    widths = [("moe_intermediate_size", spec.expert_intermediate_size)] if spec.num_experts else []
    if spec.moe_layers < spec.num_layers:  # dense layers (all of a dense model; GLM-4.5's first ones)
        widths.append(("intermediate_size", spec.intermediate_size))
    if spec.shared_expert_intermediate_size:
        widths.append(("the shared experts' width", spec.shared_expert_intermediate_size))
    for what, n in (("attention heads", spec.num_heads), ("num_key_value_heads", spec.num_kv_heads), *widths):
        if n % world:
            raise ConfigError(f"tensor parallelism over {world} devices needs {what} ({n}) divisible by {world}")


def local_spec(spec: ModelSpec, world: int) -> ModelSpec:
    """``spec`` as one rank's KV cache sees it: its share of the KV heads."""
    return dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // world)


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t.contiguous(), requires_grad=False)


def _rows(linear_mod: torch.nn.Linear, parts: list[tuple[int, int]]) -> None:
    """Keep output rows ``parts`` ([(begin, end)], concatenated) of a Linear, and its bias rows."""
    linear_mod.weight = _param(torch.cat([linear_mod.weight[a:b] for a, b in parts]))
    if linear_mod.bias is not None:
        linear_mod.bias = _param(torch.cat([linear_mod.bias[a:b] for a, b in parts]))


def _columns(linear_mod: torch.nn.Linear, a: int, b: int, keep_bias: bool) -> None:
    """Keep input columns [a, b) of a Linear; its bias only where ``keep_bias`` (rank 0)."""
    linear_mod.weight = _param(linear_mod.weight[:, a:b])
    if linear_mod.bias is not None and not keep_bias:
        linear_mod.bias = None


def slice_layer(layer: torch.nn.Module, spec: ModelSpec, rank: int, world: int) -> None:
    """Cut one decoder layer (in place) down to rank ``rank``'s share of heads and MLP columns."""
    D = spec.head_dim
    attn, m = layer.self_attn, layer.mlp
    # A routed layer's experts split by their width; a dense layer (GLM-4.5's first) by its own.
    width = spec.expert_intermediate_size if hasattr(m, "experts") else spec.intermediate_size
    nh, nkv, inter = spec.num_heads // world, spec.num_kv_heads // world, width // world
    q = (rank * nh * D, (rank + 1) * nh * D)  # rows of q_proj / columns of o_proj
    kv = (rank * nkv * D, (rank + 1) * nkv * D)
    mlp = (rank * inter, (rank + 1) * inter)
    if hasattr(attn, "qkv_proj"):  # Phi-3: rows [q | k | v] of one fused projection
        qs, kvs = spec.num_heads * D, spec.num_kv_heads * D
        _rows(attn.qkv_proj, [q, (qs + kv[0], qs + kv[1]), (qs + kvs + kv[0], qs + kvs + kv[1])])
    else:
        _rows(attn.q_proj, [q])
        _rows(attn.k_proj, [kv])
        _rows(attn.v_proj, [kv])
    _columns(attn.o_proj, q[0], q[1], keep_bias=rank == 0)
    if hasattr(m, "experts"):  # fused experts: gate_up [E, 2I, H] rows [gate | up], down [E, H, I] columns
        e = m.experts
        e.gate_up_proj = _param(torch.cat((e.gate_up_proj[:, mlp[0]:mlp[1]],
                                           e.gate_up_proj[:, width + mlp[0]:width + mlp[1]]), dim=1))
        e.down_proj = _param(e.down_proj[:, :, mlp[0]:mlp[1]])
        e.intermediate_dim = inter
        shared = getattr(m, "shared_experts", None)  # GLM-4.5: a dense MLP every token runs, split alike
        if shared is not None:
            part = shared.gate_proj.weight.shape[0] // world
            for lin in (shared.gate_proj, shared.up_proj):
                _rows(lin, [(rank * part, (rank + 1) * part)])
            _columns(shared.down_proj, rank * part, (rank + 1) * part, keep_bias=rank == 0)
    elif hasattr(m, "gate_up_proj"):  # Phi-3: rows [gate | up]
        _rows(m.gate_up_proj, [mlp, (spec.intermediate_size + mlp[0], spec.intermediate_size + mlp[1])])
    else:
        _rows(m.gate_proj, [mlp])
        _rows(m.up_proj, [mlp])
    if not hasattr(m, "experts"):
        _columns(m.down_proj, mlp[0], mlp[1], keep_bias=rank == 0)


class TPShard(Shard):
    """One rank's part of a tensor-parallel shard; rank 0's is what the compute worker runs.

    ``comm`` is a :class:`~p2pserve.model.tp_comm.TPComm` (rank, world, the collectives, and on
    rank 0 the step layout it sends); ``shard_id`` names this shard in those messages.
    """

    comm = None
    shard_id = 0

    @classmethod
    def load_split(cls, model_path: str, spec: ModelSpec, start: int, end: int, device: str, comm,
                   shard_id: int) -> "TPShard":
        """Read layers [start, end) on the CPU, keep this rank's slices and move them to ``device``.

        The whole layers pass through host memory once (the checkpoint stores them whole); only
        the slices reach the device.
        """
        check_splittable(spec, comm.world)
        shard = cls.load(model_path, spec, start, end, device="cpu")
        for layer in shard.layers:
            slice_layer(layer, spec, comm.rank, comm.world)
        if comm.rank:  # embeddings and head run on rank 0 only
            shard.embed_tokens = shard.norm = shard.lm_head = None
        shard.comm, shard.shard_id = comm, shard_id
        shard.to(device)
        shard.device = torch.device(device)
        if shard._fast_plan() is None:
            raise ConfigError(f"tensor parallelism needs a known layer layout; {spec.family} layers were not recognised")
        return shard

    # ------------------------------------------------------------------ every rank
    def compute(self, segments: list[Segment]) -> None:
        """Run every segment's hidden states (``seg.hidden`` [n, H]) through its span, in place.

        Identical on every rank: the all-reduces inside each layer pair up across ranks.
        """
        rope_rows = self._rope_rows(segments, segments[0].hidden)
        self._run_layers(segments, rope_rows, self._layer_fast)

    def _layer_fast(self, layer_idx: int, x: torch.Tensor, cos, sin, segments: list[Segment]) -> torch.Tensor:
        """`Shard._layer_fast` on this rank's heads and MLP columns, all-reducing the two partial sums."""
        p = self._plan[layer_idx - self.start]
        spec, world = self.spec, self.comm.world
        D = spec.head_dim
        h = rms_norm(x, p.input_norm)
        q, k, v = qkv_of(h, p, spec.num_heads // world * D, spec.num_kv_heads // world * D, D)  # local heads
        if p.q_norm is not None:
            q, k = rms_norm(q, p.q_norm), rms_norm(k, p.k_norm)
        q, k = rope(q, k, cos, sin)
        o = self._attention(layer_idx, q, k, v, segments, p.scaling)  # [T, nH/w * D]
        x = self.comm.all_reduce(linear(o, *p.o)).add_(x)  # x + o_proj(o), summed over ranks [T, H]
        return x.add_(self.comm.all_reduce(gated_mlp(rms_norm(x, p.post_norm), p)))

    # ------------------------------------------------------------------ rank 0
    @torch.inference_mode()
    def forward_batch(self, segments: list[Segment]) -> list[torch.Tensor]:
        """`Shard.forward_batch` across the group: checks, embeds, sends the step, runs it, heads.

        Anything that could refuse a segment is checked before the step is sent: once sent, every
        rank must run it to the end, so a failure after that point fails the whole group.
        """
        comm = self.comm
        if comm.failed:
            raise RequestError("this peer's tensor-parallel group failed; retry elsewhere")
        dtype = TORCH_DTYPES[self.spec.dtype]
        for seg in segments:
            _check_segment(self, seg)
        for seg in segments:
            inputs = seg.inputs.to(self.device)
            seg.hidden = F.embedding(inputs, self.embed_tokens.weight) if seg.start == 0 else inputs.to(dtype)
        hidden = torch.cat([s.hidden for s in segments])  # [sum n, H]
        layout = [(_cache_key(comm, s.cache), s.position, s.n, s.start, s.end,
                   -1 if s.rope_end is None else s.rope_end, s.cache.max_length) for s in segments]
        with comm.lock:
            try:
                comm.send_step(self.shard_id, layout, hidden)
                self.compute(segments)
            except Exception as e:
                comm.fail(f"a collective failed: {type(e).__name__}: {e}")
                raise RequestError("this peer's tensor-parallel group failed; retry elsewhere") from e
        return self._outputs(segments)

    def _outputs(self, segments: list[Segment]) -> list[torch.Tensor]:
        """Hidden states [n, H] per segment, or logits [V] / [rows, V] where asked (one head matmul)."""
        outputs: list[torch.Tensor] = [seg.hidden for seg in segments]
        wanting = [i for i, seg in enumerate(segments) if seg.want_logits]
        if not wanting:
            return outputs
        last = torch.cat([segments[i].hidden[-segments[i].logit_rows:] for i in wanting])  # [sum rows, H]
        norm, head_t, head_bias = self._head
        logits = linear(rms_norm(last, norm), head_t, head_bias).float().cpu()  # [sum rows, V]
        split_logits(segments, wanting, logits, outputs)
        return outputs


def _check_segment(shard: TPShard, seg: Segment) -> None:
    """Refuse, before the group runs anything, what `Shard.forward_batch` would refuse midway."""
    if not (shard.start <= seg.start < seg.end <= shard.end):
        raise BadRequestError(f"span [{seg.start}, {seg.end}) is not inside this shard")
    seg.cache.truncate(seg.position)  # every rank holds exactly the positions before this segment
    if seg.cache.length != seg.position:
        raise BadRequestError(f"position {seg.position} is past the {seg.cache.length} cached tokens")
    if seg.position + seg.n > seg.cache.max_length:
        raise BadRequestError(f"session exceeds its declared max_length {seg.cache.max_length}")
    if seg.want_logits and (shard.lm_head is None or seg.end != shard.spec.num_layers):
        raise BadRequestError("logits requested from a span that does not end at the last layer")
    if shard._head is None and seg.want_logits:
        raise BadRequestError("this shard's head was not recognised")


def _cache_key(comm, cache) -> int:
    """The number other ranks know this session's cache by; when rank 0's cache is collected the
    number is sent with the next message, so the other ranks free theirs too."""
    key = getattr(cache, "_tp_key", None)
    if key is None:
        key = cache._tp_key = next(_cache_keys)
        weakref.finalize(cache, comm.dropped_caches.append, key)
    return key
