"""Routed-experts families (Qwen3-MoE, Mixtral, GLM-4.5, GPT-OSS, DeepSeek-V3) in one process: the checkpoint layout, memory and
compute facts, batching and speculative rows, and quantization of the experts.

Greedy tokens of a whole-model shard against `generate` (fast path, and module path with a
chunked prefill) are in tests/unit/model/test_family_checkpoints.py, which runs every family of
`tiny_families`; tensor parallelism in tests/unit/model/test_tensor_parallel.py; the peers in
tests/integration/test_moe_families.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from p2pserve.errors import BadRequestError
from p2pserve.model.family_configs import FAMILIES
from p2pserve.model.experts import LinearExperts, fuse_layer_tensors, unfuse_experts
from p2pserve.model.gpt_oss_experts import BiasedLinearExperts
from p2pserve.model.shard import Segment, Shard
from p2pserve.model.spec import load_spec
from p2pserve.model.tiny_families import build_family_model
from p2pserve.peer.kv_cache import SequenceCache

MOE = ["qwen3-moe", "mixtral", "glm4.5", "gpt-oss", "deepseek-v3"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    built: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in built:
            built[family] = str(build_family_model(family, root / family, seed=0))
        return built[family]

    return get


def _cache(spec, start=0, end=None):
    heads, k_dim, v_dim = spec.kv_layout  # latent attention caches a latent and a rotary key
    return SequenceCache(start, end or spec.num_layers, heads, k_dim, 128, torch.float32, v_dim=v_dim)


@pytest.mark.parametrize("family", MOE)
def test_the_checkpoint_stores_each_expert_and_the_shard_holds_them_fused(moe_dir, family):
    path = moe_dir(family)
    names = json.loads(open(f"{path}/model.safetensors.index.json").read())["weight_map"]
    block, gate = ("block_sparse_moe", "w1") if family == "mixtral" else ("mlp", "gate_proj")
    if family == "gpt-oss":  # stored fused and transposed, with biases (MXFP4 in the hub's: test_mxfp4.py)
        assert "model.layers.2.mlp.experts.gate_up_proj_bias" in names and "model.layers.2.mlp.router.bias" in names
    else:
        assert f"model.layers.2.{block}.experts.7.{gate}.weight" in names  # the hub's per-expert layout
        assert not any("gate_up_proj" in n for n in names)
    spec = load_spec(path)
    dense = 1 if family in ("glm4.5", "deepseek-v3") else 0  # their first layers are dense
    assert (spec.num_experts, spec.experts_per_token, spec.moe_layers) == (8, 2, spec.num_layers - dense)
    shard = Shard.load(path, spec, 2, 4)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).model.layers[3].mlp
    mine = shard.layers[1].mlp
    assert torch.equal(mine.experts.gate_up_proj, ref.experts.gate_up_proj)  # [E, 2I, H], as transformers fuses
    assert torch.equal(mine.experts.down_proj, ref.experts.down_proj)
    router = "router" if family == "gpt-oss" else "gate"
    assert torch.equal(getattr(mine, router).weight, getattr(ref, router).weight)


def test_fusing_passes_fused_tensors_through_and_refuses_missing_experts():
    fused = {"mlp.experts.gate_up_proj": torch.zeros(2, 4, 3), "mlp.gate.weight": torch.zeros(2, 3)}
    assert fuse_layer_tensors("qwen3_moe", dict(fused)).keys() == fused.keys()
    partial = {f"block_sparse_moe.experts.{e}.{w}.weight": torch.zeros(2, 3) for e in (0, 2) for w in ("w1", "w2", "w3")}
    with pytest.raises(BadRequestError, match="incomplete set of experts"):
        fuse_layer_tensors("mixtral", partial)


@pytest.mark.parametrize("family", MOE)
def test_memory_counts_every_expert_and_compute_only_the_routed_ones(moe_dir, family, tmp_path):
    """What a peer's layer budget, its announcement and the planner read: every expert in memory
    (within the norms' few weights of the loaded tensors); on the real shapes, experts are most
    of a layer's bytes and the routed ones little of its compute."""
    path = moe_dir(family)
    spec = load_spec(path)
    shard = Shard.load(path, spec, 0, spec.num_layers)
    held = sum(p.numel() for layer in shard.layers for p in layer.parameters())
    assert abs(held - spec.num_layers * spec.layer_param_count) / held < 0.01
    assert spec.layer_bytes == spec.layer_param_count * 4
    (tmp_path / "config.json").write_text(json.dumps(FAMILIES[family]["config"]))
    real = load_spec(tmp_path, dtype="bfloat16")
    experts = real.num_experts * 3 * real.hidden_size * real.expert_intermediate_size
    assert experts / real.layer_param_count > 0.9
    assert real.layer_active_param_count < 0.4 * real.layer_param_count
    # Qwen3-30B-A3B: 48 layers of ~0.63 B weights (~30 B total), ~3 B active per token
    assert family != "qwen3-moe" or (29e9 < 48 * real.layer_param_count < 31e9
                                     and 48 * real.layer_active_param_count < 3.5e9)


@pytest.mark.parametrize("family", MOE)
def test_a_batched_step_routes_each_session_as_if_alone(moe_dir, family):
    """Three sessions of different lengths and positions in one step give each its own logits
    (the experts' matmuls group tokens of several sessions, so equal within fp32 rounding), and
    speculative rows (``logit_rows``) are the one-token steps' logits."""
    path = moe_dir(family)
    spec = load_spec(path)
    shard = Shard.load(path, spec, 0, spec.num_layers)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, spec.vocab_size - 8, (n,), generator=gen) for n in (9, 1, 14)]
    alone = []
    for x in prompts:
        (logits,) = shard.forward_batch([Segment(x, 0, 0, spec.num_layers, _cache(spec), want_logits=True)])
        alone.append(logits)
    together = shard.forward_batch([Segment(x, 0, 0, spec.num_layers, _cache(spec), want_logits=True) for x in prompts])
    for a, b in zip(alone, together):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        assert int(a.argmax()) == int(b.argmax())
    # speculative verification: the last 4 rows of one call == a prefill then 3 one-token steps
    x, c1, c2 = prompts[2], _cache(spec), _cache(spec)
    rows = shard.forward_batch([Segment(x, 0, 0, spec.num_layers, c1, want_logits=True, logit_rows=4)])[0]  # [4, V]
    steps = shard.forward_batch([Segment(x[:-3], 0, 0, spec.num_layers, c2, want_logits=True)])
    for i in range(len(x) - 3, len(x)):
        steps += shard.forward_batch([Segment(x[i:i + 1], i, 0, spec.num_layers, c2, want_logits=True)])
    for row, one in zip(rows, steps):
        torch.testing.assert_close(row, one, rtol=1e-4, atol=1e-4)
        assert int(row.argmax()) == int(one.argmax())


def test_linear_experts_run_the_eager_loop_bit_for_bit(moe_dir):
    """The per-expert ``nn.Linear`` form a quantizer works on computes what transformers' eager
    experts loop computes on the fused tensors, bit for bit."""
    path = moe_dir("mixtral")
    spec = load_spec(path)
    shard = Shard.load(path, spec, 0, 1)
    block = shard.layers[0].mlp
    fused = block.experts
    fused.config._experts_implementation = "eager"
    h = torch.randn(11, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        _, weights, index = block.gate(h)
        want = fused(h, index, weights)
        got = LinearExperts(fused)(h, index, weights)
    assert torch.equal(got, want)
    assert unfuse_experts(shard.layers) == 1 and isinstance(shard.layers[0].mlp.experts, LinearExperts)


def test_biased_linear_experts_run_gpt_oss_experts_math(moe_dir):
    """GPT-OSS's experts (transposed, interleaved gate/up, biases, clamped SwiGLU) as per-expert
    ``nn.Linear``s compute what transformers' eager loop computes (``x @ W + b`` there, ``addmm``
    here: equal to fp32 rounding)."""
    path = moe_dir("gpt-oss")
    spec = load_spec(path)
    shard = Shard.load(path, spec, 0, 1)
    block = shard.layers[0].mlp
    fused = block.experts
    fused.config._experts_implementation = "eager"
    h = torch.randn(11, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        _, weights, index = block.router(h)
        want = fused(h, index, weights)
        got = BiasedLinearExperts(fused)(h, index, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert unfuse_experts(shard.layers) == 1 and isinstance(shard.layers[0].mlp.experts, BiasedLinearExperts)


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("family", ["qwen3-moe", "gpt-oss"])
def test_weight_only_quantization_covers_the_experts(moe_dir, quant, family):
    pytest.importorskip("torchao", reason="the 'quant' extra is not installed")
    from p2pserve.model.quant import weight_bytes

    path = moe_dir(family)
    full = Shard.load(path, load_spec(path), 0, 2)
    spec = load_spec(path, quant=quant)
    shard = Shard.load(path, spec, 0, 2)
    assert not any(p.dim() == 3 for p in shard.layers.parameters())  # no full-width fused experts left
    measured = weight_bytes(shard.layers)
    assert measured < weight_bytes(full.layers) / 3  # fp32 -> ~1 byte per weight
    # What the peer's budget counts. GPT-OSS's full-width biases (experts', attention's) and the
    # per-row scales are 5% of a layer at these tiny widths, well under 0.1% at the real ones.
    assert abs(measured - 2 * spec.layer_bytes) / measured < (0.08 if family == "gpt-oss" else 0.05)


@pytest.mark.parametrize("family", ["kimi_k2"])
def test_moe_families_not_served_yet_are_refused_by_name(tmp_path, family):
    """Kimi K2's model_type is not in the shard: a peer and a client refuse it at start, naming
    the family."""
    from p2pserve.errors import UnsupportedModelError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": family, "num_hidden_layers": 2}))
    with pytest.raises(UnsupportedModelError, match=f"model family '{family}'.*qwen3_moe"):
        load_spec(tmp_path)


def test_tensor_parallelism_splits_dense_layers_and_shared_experts_by_their_widths(moe_dir):
    """GLM-4.5's first layers are dense and its routed ones run a shared expert: each splits by its
    own width, so a width that does not divide is named."""
    from p2pserve.errors import ConfigError
    from p2pserve.model.tensor_parallel import check_splittable

    spec = load_spec(moe_dir("glm4.5"))
    check_splittable(spec, 2)  # 24:2 heads, 64-wide experts, 384-wide dense layer
    with pytest.raises(ConfigError, match="intermediate_size"):
        check_splittable(dataclasses.replace(spec, intermediate_size=383), 2)
    with pytest.raises(ConfigError, match="shared experts"):
        check_splittable(dataclasses.replace(spec, shared_expert_intermediate_size=63, expert_intermediate_size=64), 2)
    check_splittable(load_spec(moe_dir("qwen3-moe")), 2)  # 16:2 heads and 64-wide experts split
    with pytest.raises(ConfigError, match="gpt_oss"):
        check_splittable(load_spec(moe_dir("gpt-oss")), 2)


def test_a_peer_offers_the_layers_its_memory_holds_with_every_expert(tmp_path):
    """Qwen3-30B-A3B in bf16: 24 GiB for weights hold 20 layers of ~0.63 B weights each (all 128
    experts), not the ~200 its 3 B active weights per token would suggest; int8 about doubles it."""
    from p2pserve.cli.peer import config_from_args, max_layers_of
    from p2pserve.cli import build_parser

    (tmp_path / "config.json").write_text(json.dumps(FAMILIES["qwen3-moe"]["config"]))
    config = config_from_args(build_parser("peer").parse_args(["peer", "--weights-memory-gb", "24"]))
    spec = load_spec(tmp_path, dtype="bfloat16")
    assert max_layers_of(spec, config) == 24 * 2**30 // spec.layer_bytes == 20
    assert 36 <= max_layers_of(load_spec(tmp_path, dtype="bfloat16", quant="int8"), config) <= 40
