"""Real-shaped checkpoints of every supported family, in one process: folder layout, specs, and
greedy tokens of a `Shard` holding every layer against transformers `generate` on the same folder.

The peers and the wire are covered by tests/integration/test_families.py; here the shard's
arithmetic is pinned down per family: the fast path and the module path both give `generate`'s
tokens (fp32), the fast path is bit-identical to the module path, and a prefill cut into chunks
(as a peer's token throttle cuts it) gives the same tokens as one whole prefill.
"""

from __future__ import annotations

import json

import pytest
import torch

from p2pserve.errors import UnknownModelError, UnsupportedModelError
from p2pserve.model.family_configs import FAMILIES, GEMMA_2_2B_IT
from p2pserve.model.shard import TORCH_DTYPES, Segment, Shard
from p2pserve.model.spec import load_spec
from p2pserve.model.tiny_families import TINY_FAMILY_NAMES, build_family_model
from p2pserve.peer.kv_cache import SequenceCache

PROMPT_LEN, NEW_TOKENS = 56, 16  # phi3.5's longrope switch (64) and mistral's window (64) are crossed


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    built: dict[tuple, str] = {}

    def get(family: str, dtype: str = "float32") -> str:
        if (family, dtype) not in built:
            built[family, dtype] = str(build_family_model(family, root / f"{family}-{dtype}", seed=0, dtype=dtype))
        return built[family, dtype]

    return get


def prompt(spec, seed: int = 1) -> list[int]:
    return torch.randint(3, spec.vocab_size - 8, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(path: str, ids: list[int], n: int, dtype=torch.float32) -> list[int]:
    """Greedy `generate`, with the generation_config's repetition penalty (Qwen2.5: 1.1) and
    EOS stop turned off: p2pserve applies neither, the test compares the arithmetic."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         repetition_penalty=1.0, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def shard_greedy(path: str, ids: list[int], n: int, dtype: str = "float32", module_path: bool = False,
                 chunk: int | None = None) -> list[int]:
    """Greedy tokens from one Shard over every layer, fed as a client and a peer feed it: the
    prompt in chunks of ``chunk`` (each told the whole request's end), then one token per step,
    re-sending everything once the sequence outgrows ``spec.recompute_past`` (Generation's rule)."""
    spec = load_spec(path, dtype=dtype)
    shard = Shard.load(path, spec, 0, spec.num_layers)
    if module_path:
        shard._plan, shard._plan_built = None, True
    heads, k_dim, v_dim = spec.kv_layout  # latent attention caches a latent and a rotary key
    cache = SequenceCache(0, spec.num_layers, heads, k_dim, 256, TORCH_DTYPES[dtype], v_dim=v_dim)
    history, pending, out = [], list(ids), []
    while len(out) < n:
        if spec.recompute_past is not None and 0 < len(history) <= spec.recompute_past < len(history) + len(pending):
            pending, history = history + pending, []
            cache.truncate(0)
        step = chunk or len(pending)
        for at in range(0, len(pending), step):
            part = torch.tensor(pending[at:at + step])
            seg = Segment(part, len(history) + at, 0, spec.num_layers, cache, want_logits=at + step >= len(pending),
                          rope_end=len(history) + len(pending))
            (logits,) = shard.forward_batch([seg])
        history += pending
        pending = [int(logits.argmax())]
        out.append(pending[0])
    return out


def test_folders_are_shaped_like_the_hub(family_dir):
    for family in TINY_FAMILY_NAMES:
        path = family_dir(family)
        index = json.loads(open(f"{path}/model.safetensors.index.json").read())
        assert len(set(index["weight_map"].values())) > 1, family  # really sharded
        gen = json.loads(open(f"{path}/generation_config.json").read())
        real = FAMILIES[family]["generation"]["eos_token_id"]
        assert len(gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [0]) == (
            len(real) if isinstance(real, list) else 1)
        raw = json.loads(open(f"{path}/config.json").read())
        assert "torch_dtype" in raw and "rope_theta" in raw  # the hub's format, not a re-serialisation
    qwen3 = load_spec(family_dir("qwen3"))
    assert qwen3.head_dim * qwen3.num_heads != qwen3.hidden_size  # decoupled, as in Qwen3-0.6B
    assert load_spec(family_dir("llama3")).tie_word_embeddings and load_spec(family_dir("qwen2.5")).tie_word_embeddings
    assert load_spec(family_dir("phi3.5")).recompute_past == 64 and load_spec(family_dir("phi3-4k")).recompute_past is None


@pytest.mark.parametrize("family", TINY_FAMILY_NAMES)
def test_shard_greedy_matches_generate(family_dir, family):
    path = family_dir(family)
    ids = prompt(load_spec(path))
    ref = reference(path, ids, NEW_TOKENS)
    assert shard_greedy(path, ids, NEW_TOKENS) == ref, "fast path"
    assert shard_greedy(path, ids, NEW_TOKENS, module_path=True, chunk=16) == ref, "module path, chunked prefill"


@pytest.mark.parametrize("family", ["llama3", "qwen2.5", "qwen3", "phi3.5", "qwen3-moe", "mixtral", "glm4.5",
                                    "gpt-oss"])
def test_fast_path_is_bit_identical_to_the_module_path(family_dir, family):
    path = family_dir(family)
    spec = load_spec(path)
    fast, slow = Shard.load(path, spec, 0, spec.num_layers), Shard.load(path, spec, 0, spec.num_layers)
    assert fast._fast_plan() is not None
    slow._plan, slow._plan_built = None, True
    caches = [SequenceCache(0, spec.num_layers, spec.num_kv_heads, spec.head_dim, 128, torch.float32) for _ in "ab"]
    x = torch.tensor(prompt(spec))
    for step in range(6):
        pos = caches[0].length
        a = fast.forward_batch([Segment(x, pos, 0, spec.num_layers, caches[0], want_logits=True)])[0]
        b = slow.forward_batch([Segment(x, pos, 0, spec.num_layers, caches[1], want_logits=True)])[0]
        assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max().item()}"
        x = a.argmax().view(1)


def test_a_bf16_folder_serves_in_fp32_exactly_and_in_bf16(family_dir):
    """Stored bf16, computed in fp32 (the peer's default --dtype): token-identical to `generate`
    loading the same folder in fp32. Computed in bf16 (--dtype bfloat16): the same tokens as
    `generate` in bf16 here, where the shard runs the same bf16 ops in the same order; a bf16
    argmax can flip on a different kernel, so the swarm promises exactness in fp32 only."""
    path = family_dir("llama3", "bfloat16")
    raw = json.loads(open(f"{path}/config.json").read())
    assert raw["torch_dtype"] == "bfloat16"
    from safetensors import safe_open

    index = json.loads(open(f"{path}/model.safetensors.index.json").read())
    name, fname = next(iter(index["weight_map"].items()))
    with safe_open(f"{path}/{fname}", framework="pt") as f:
        assert f.get_tensor(name).dtype == torch.bfloat16
    ids = prompt(load_spec(path))
    assert shard_greedy(path, ids, 8) == reference(path, ids, 8)
    assert shard_greedy(path, ids, 6, dtype="bfloat16") == reference(path, ids, 6, dtype=torch.bfloat16)


def test_an_unsupported_family_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GEMMA_2_2B_IT))
    with pytest.raises(UnsupportedModelError, match="gemma2") as info:
        load_spec(tmp_path)
    assert info.value.family == "gemma2" and "phi3" in str(info.value)  # says what is supported
    assert isinstance(info.value, UnknownModelError)  # callers catching the broader error still do
    from p2pserve.client.model_info import LocalModelInfo

    with pytest.raises(UnsupportedModelError, match="gemma2"):
        LocalModelInfo.load(str(tmp_path))


def test_partial_rotary_is_refused(family_dir, tmp_path):
    raw = json.loads(open(f"{family_dir('phi3-4k')}/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, partial_rotary_factor=0.75)))
    with pytest.raises(UnsupportedModelError, match="partial rotary"):
        load_spec(tmp_path)


def test_the_client_ends_replies_on_every_generation_config_eos(family_dir):
    from p2pserve.client.model_info import LocalModelInfo

    info = LocalModelInfo.load(family_dir("llama3"))
    tok = info.tokenizer
    assert info.eos_ids == {tok.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")}
    ids = info.chat_ids([{"role": "user", "content": "Hello!"}])
    assert tok.decode(ids).startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>")
