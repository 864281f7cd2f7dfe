"""Tensor-parallel shards: the weight split, and a TP-2 group (this process + one real child rank
over gloo) against the unsplit shard on the same tiny model."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch

from p2pserve.errors import BadRequestError, ConfigError
from p2pserve.model.shard import Segment, Shard
from p2pserve.model.spec import load_spec
from p2pserve.model.tensor_parallel import check_splittable, local_spec, slice_layer
from p2pserve.peer.kv_cache import SequenceCache
from p2pserve.peer.tp_group import TPGroup, parse_gpus, tp_devices
from p2pserve.config import TPConfig


def test_slices_of_all_ranks_put_together_are_the_layer(model_dir):
    for family in ("llama", "qwen2"):
        path = model_dir(family)
        spec = load_spec(path)
        full = Shard.load(path, spec, 0, 1)
        parts = [Shard.load(path, spec, 0, 1) for _ in range(2)]
        for rank, part in enumerate(parts):
            slice_layer(part.layers[0], spec, rank, 2)
        a, b = (p.layers[0] for p in parts)
        f = full.layers[0]
        for name in ("q_proj", "k_proj", "v_proj"):
            w = torch.cat([getattr(a.self_attn, name).weight, getattr(b.self_attn, name).weight])
            assert torch.equal(w, getattr(f.self_attn, name).weight)
            if getattr(f.self_attn, name).bias is not None:  # qwen2: q/k/v biases split with their rows
                assert torch.equal(torch.cat([getattr(a.self_attn, name).bias, getattr(b.self_attn, name).bias]),
                                   getattr(f.self_attn, name).bias)
        assert torch.equal(torch.cat([a.self_attn.o_proj.weight, b.self_attn.o_proj.weight], 1), f.self_attn.o_proj.weight)
        assert torch.equal(torch.cat([a.mlp.down_proj.weight, b.mlp.down_proj.weight], 1), f.mlp.down_proj.weight)
        assert torch.equal(torch.cat([a.mlp.gate_proj.weight, b.mlp.gate_proj.weight]), f.mlp.gate_proj.weight)
        assert a.self_attn.q_proj.weight.shape[0] == spec.num_heads // 2 * spec.head_dim


def test_unsplittable_layouts_are_config_errors(model_dir):
    spec = load_spec(model_dir("llama"))  # 4 heads, 2 KV heads, intermediate 128
    check_splittable(spec, 2)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        check_splittable(spec, 4)
    with pytest.raises(ConfigError, match="quant"):
        check_splittable(dataclasses.replace(spec, quant="int8"), 2)
    assert local_spec(spec, 2).num_kv_heads == 1


def test_device_flags():
    assert parse_gpus("1") == (1,) and parse_gpus("0,1,2,3") == (0, 1, 2, 3)
    with pytest.raises(ConfigError):
        parse_gpus("0,0")
    assert tp_devices("cpu", None, 2) == ("cpu", "cpu")
    assert tp_devices("cpu", None, None) is None and tp_devices("cuda:1", (1,), None) is None
    assert tp_devices("cuda:0", (0, 1), None) == ("cuda:0", "cuda:1")
    with pytest.raises(ConfigError):
        tp_devices("cuda:0", None, 2)  # CUDA TP names its devices
    with pytest.raises(ConfigError):
        tp_devices("cuda:0", (0, 1), 4)


def test_peer_flags_build_the_tp_config():
    import argparse

    from p2pserve.cli.peer import add_arguments, config_from_args, tp_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--tp", "2", "--num-threads", "1"])
    tp = tp_from_args(args, config_from_args(args))
    assert tp == TPConfig(devices=("cpu", "cpu"), num_threads=1) and tp.world == 2
    args = parser.parse_args([])
    assert tp_from_args(args, config_from_args(args)) is None
    with pytest.raises(ConfigError):  # --tp on CUDA must name its devices
        tp_from_args(parser.parse_args(["--tp", "2"]), dataclasses.replace(config_from_args(args), device="cuda:0"))


def _caches(spec, n, kv_heads):
    return [SequenceCache(0, spec.num_layers, kv_heads, spec.head_dim, 48, torch.float32) for _ in range(n)]


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "phi3.5", "qwen3-moe", "glm4.5"])
def test_tp2_group_matches_the_unsplit_shard(model_dir, tmp_path, family):
    # qwen3: per-head q/k norms; mistral: a 24-token window the prompts pass; phi3.5 (shaped like
    # the real checkpoint): fused qkv and gate_up, longrope; qwen3-moe: routed experts split by
    # their MLP width; glm4.5: a dense first layer, a shared expert, q/k/v biases, partial rotary.
    # (Qwen2's q/k/v biases: the slicing test.)
    if family in ("phi3.5", "qwen3-moe", "glm4.5"):
        from p2pserve.model.tiny_families import build_family_model

        path = str(build_family_model(family, tmp_path / family, seed=0))
    else:
        path = model_dir(family)
    spec = load_spec(path)
    full = Shard.load(path, spec, 0, spec.num_layers)
    group = TPGroup.start(TPConfig(devices=("cpu", "cpu"), num_threads=1), path, spec)
    try:
        tp = group.load(path, spec, 0, spec.num_layers)
        ref_caches, tp_caches = _caches(spec, 2, spec.num_kv_heads), _caches(spec, 2, spec.num_kv_heads // 2)
        prompts = [torch.randint(3, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in (30, 26)]

        def run(shard, caches, inputs, position):
            return shard.forward_batch([Segment(x, p, 0, spec.num_layers, c, want_logits=True)
                                        for x, p, c in zip(inputs, position, caches)])

        ref = run(full, ref_caches, prompts, [0, 0])  # a batched prefill of two sessions
        got = run(tp, tp_caches, prompts, [0, 0])
        positions = [30, 26]
        for _ in range(6):  # batched greedy decode
            for r, g in zip(ref, got):
                torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)
                assert int(g.argmax()) == int(r.argmax())
            nxt = [r.argmax().reshape(1) for r in ref]
            ref, got = run(full, ref_caches, nxt, positions), run(tp, tp_caches, nxt, positions)
            positions = [p + 1 for p in positions]
        # a rewind (the session re-runs its last token) is mirrored on the child by position alone
        again = run(tp, tp_caches[:1], [nxt[0]], [positions[0] - 1])
        torch.testing.assert_close(again[0], got[0], rtol=1e-5, atol=1e-5)
        with pytest.raises(BadRequestError):  # refused before the step reaches the child
            run(tp, tp_caches[:1], [nxt[0]], [positions[0] + 3])
        if family == "llama":
            old = weakref.ref(tp)
            del tp  # the peer moves on: nothing holds the first shard any more
            _load_another_range(group, path, spec, old)
        assert group.comm.failed is None and all(c.poll() is None for c in group.children)
    finally:
        group.stop()
    assert all(c.returncode == 0 for c in group.children)


def _load_another_range(group, path, spec, old) -> None:
    """A plan moves the peer: a second range loads on every rank, the first is dropped once
    collected, and the new one computes hidden states [n, H] equal to the unsplit shard's."""
    import gc

    new = group.load(path, spec, 0, 4)
    gc.collect()
    assert old() is None  # collected: its id goes to the child with the next message (or ping)
    ids = torch.arange(3, 13)
    ref = Shard.load(path, spec, 0, 4).forward_batch([Segment(ids, 0, 0, 4, _caches(spec, 1, spec.num_kv_heads)[0])])
    got = new.forward_batch([Segment(ids, 0, 0, 4, _caches(spec, 1, spec.num_kv_heads // 2)[0])])
    assert not group.comm.dropped_shards  # sent
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-5)
