"""The shard's fast path must give the same bits as transformers' own modules and functions.

`reference_forward` is the shard's batching scheme written with the transformers modules
(``nn.Module`` calls) and transformers' ``apply_rotary_pos_emb`` with per-step rotary tables,
i.e. the computation before the fast path existed. Every comparison is ``torch.equal``.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from p2pserve.model.attention import attention_mask as _attention_mask
from p2pserve.model.shard import Segment, Shard
from p2pserve.model.spec import SUPPORTED_FAMILIES, load_spec
from p2pserve.model.tiny import build_tiny_model
from p2pserve.peer.kv_cache import SequenceCache

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


@torch.inference_mode()
def reference_forward(shard: Shard, segments: list[Segment]) -> list[torch.Tensor]:
    apply_rotary_pos_emb = importlib.import_module(SUPPORTED_FAMILIES[shard.spec.family][0]).apply_rotary_pos_emb
    for seg in segments:
        seg.hidden = shard.embed_tokens(seg.inputs) if seg.start == 0 else seg.inputs
    positions = torch.cat([torch.arange(s.position, s.position + s.n) for s in segments])
    cos_all, sin_all = shard.rotary(segments[0].hidden[None], positions[None])  # [1, T, D]
    offsets = [sum(s.n for s in segments[:i]) for i in range(len(segments))]
    D = shard.spec.head_dim
    for layer_idx in range(min(s.start for s in segments), max(s.end for s in segments)):
        active = [i for i, s in enumerate(segments) if s.start <= layer_idx < s.end]
        if not active:
            continue
        rows = torch.cat([torch.arange(offsets[i], offsets[i] + segments[i].n) for i in active])
        cos, sin = cos_all[0, rows], sin_all[0, rows]
        x = torch.cat([segments[i].hidden for i in active])
        layer = shard.layers[layer_idx - shard.start]
        attn = layer.self_attn
        T = x.shape[0]
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(T, -1, D)
        k = attn.k_proj(h).view(T, -1, D)
        v = attn.v_proj(h).view(T, -1, D)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        outs, at = [], 0
        for i in active:
            seg, n = segments[i], segments[i].n
            ks, vs = seg.cache.append(layer_idx, k[at : at + n].transpose(0, 1), v[at : at + n].transpose(0, 1))
            mask = _attention_mask(n, ks.shape[1], shard.windows[layer_idx - shard.start], x.device)
            o = F.scaled_dot_product_attention(
                q[at : at + n].transpose(0, 1)[None], ks[None], vs[None], attn_mask=mask, scale=attn.scaling,
                enable_gqa=True,
            )
            outs.append(o[0].transpose(0, 1).reshape(n, -1))
            at += n
        x = x + attn.o_proj(torch.cat(outs))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        at = 0
        for i in active:
            segments[i].hidden = x[at : at + segments[i].n]
            at += segments[i].n
    outputs = [s.hidden for s in segments]
    wanting = [i for i, s in enumerate(segments) if s.want_logits]
    if wanting:  # one head matmul for all of them, as the shard does (GEMM bits depend on rows)
        logits = shard.lm_head(shard.norm(torch.cat([segments[i].hidden[-1:] for i in wanting]))).float()
        for row, i in enumerate(wanting):
            outputs[i] = logits[row]
    return outputs


def _pair(path: str, start: int, end: int, module_path: bool = False):
    spec = load_spec(path)
    fast, ref = Shard.load(path, spec, start, end), Shard.load(path, spec, start, end)
    if module_path:  # force the fallback through the transformers modules
        fast._plan, fast._plan_built = None, True
    else:
        assert fast._fast_plan() is not None, "the fast path should handle this family"
    return spec, fast, ref


def _cache(spec, start, end):
    return SequenceCache(start, end, spec.num_kv_heads, spec.head_dim, 128, torch.float32)


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor], what: str):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), f"{what}: max diff {(x - y).abs().max().item()}"


def _run_sequence(path: str, start: int, end: int, decode_steps: int, module_path: bool = False):
    """Prefill 20 positions, then single-token steps; fast and reference must agree bit for bit."""
    spec, fast, ref = _pair(path, start, end, module_path)
    gen = torch.Generator().manual_seed(start)
    caches = [_cache(spec, start, end), _cache(spec, start, end)]
    last = end == spec.num_layers

    def inputs(n):
        if start == 0:
            return torch.randint(0, spec.vocab_size, (n,), generator=gen)
        return torch.randn(n, spec.hidden_size, generator=gen)

    for step in range(decode_steps + 1):
        x = inputs(20 if step == 0 else 1)
        pos = caches[0].length
        got = fast.forward_batch([Segment(x, pos, start, end, caches[0], want_logits=last)])
        want = reference_forward(ref, [Segment(x, pos, start, end, caches[1], want_logits=last)])
        _assert_same(got, want, f"[{start}, {end}) step {step}")


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_path_is_bit_identical_over_a_sequence(model_dir, family):
    path = model_dir(family)
    _run_sequence(path, 0, 8, decode_steps=12)  # mistral's window of 24 is crossed
    _run_sequence(path, 3, 6, decode_steps=4)  # hidden-state inputs, no head


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_path_is_bit_identical_for_mixed_batches(model_dir, family):
    """Segments of different lengths, positions and spans in one step, some wanting logits."""
    path = model_dir(family)
    spec, fast, ref = _pair(path, 0, 8)
    gen = torch.Generator().manual_seed(7)
    plan = [  # (new tokens, cached before, start, end, want_logits)
        (5, 0, 0, 8, True),
        (1, 30, 0, 8, True),
        (3, 12, 4, 8, True),
        (4, 7, 0, 5, False),
        (1, 26, 1, 7, False),
    ]
    caches = {}
    for name, run in (("fast", fast.forward_batch), ("ref", lambda segs: reference_forward(ref, segs))):
        caches[name] = []
        for _, cached, start, end, _ in plan:
            cache = _cache(spec, start, end)
            if cached:  # a session that already holds some positions
                g = torch.Generator().manual_seed(cached)
                prefix = (torch.randint(0, spec.vocab_size, (cached,), generator=g) if start == 0
                          else torch.randn(cached, spec.hidden_size, generator=g))
                run([Segment(prefix, 0, start, end, cache)])
            caches[name].append(cache)
    for step in range(3):
        xs = []
        for n, _, start, _, _ in plan:
            n = n if step == 0 else 1
            xs.append(torch.randint(0, spec.vocab_size, (n,), generator=gen) if start == 0
                      else torch.randn(n, spec.hidden_size, generator=gen))

        def segments(name):
            return [Segment(x, c.length, s, e, c, want_logits=w)
                    for x, c, (_, _, s, e, w) in zip(xs, caches[name], plan)]

        got = fast.forward_batch(segments("fast"))
        want = reference_forward(ref, segments("ref"))
        _assert_same(got, want, f"mixed batch step {step}")


def test_module_fallback_is_bit_identical(model_dir):
    _run_sequence(model_dir("qwen3"), 0, 8, decode_steps=3, module_path=True)


def test_dynamic_rope_is_computed_per_step(tmp_path):
    """Dynamic RoPE rescales with the sequence length: no table, still the same bits."""
    path = str(build_tiny_model("llama", tmp_path / "dyn", seed=3, max_position_embeddings=16,
                                rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}))
    _run_sequence(path, 0, 8, decode_steps=6)  # reaches position 26 > 16: frequencies change


def test_rope_table_rows_equal_per_position_rotary(model_dir):
    """A row of the table equals the rotary module's output for that position alone."""
    for family in ("llama", "qwen3"):
        path = model_dir(family)
        spec = load_spec(path)
        shard = Shard.load(path, spec, 2, 4)
        like = torch.zeros(1, spec.hidden_size)
        with torch.inference_mode():
            shard._rope_rows([Segment(like, 1000, 2, 4, None)], like)  # grows the table past 1000
            for p in [*range(0, 40), 255, 256, 257, 511, 512, 999, 1000]:
                (cos, sin), = shard._rope_rows([Segment(like, p, 2, 4, None)], like)
                ref_cos, ref_sin = shard.rotary(like[None], torch.tensor([[p]]))
                half = spec.head_dim // 2
                assert torch.equal(cos[0, 0], ref_cos[0, 0])
                assert torch.equal(sin[0, 0, half:], ref_sin[0, 0, half:])
                assert torch.equal(sin[0, 0, :half], -ref_sin[0, 0, :half])
