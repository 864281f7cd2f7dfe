"""Tiny seeded test models (Llama, Qwen2, Qwen3, Mistral) with an offline byte-level BPE tokenizer.

Weights are drawn with std 0.1 so greedy argmax gaps are wide: exactness tests then check the
pipeline, not float noise. Everything is deterministic in ``seed``; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Peer-to-peer serving splits a model's layers across many machines.",
    "Hello! How are you today? I am fine, thank you.",
    "What is the capital of France? The capital of France is Paris.",
    "Pipelines, flows, placements and caches: numbers 0 1 2 3 4 5 6 7 8 9.",
    "user assistant system <|im_start|> <|im_end|>",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(vocab_size: int = 384, special_tokens: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                    bos: str | None = "<|im_start|>", eos: str = "<|im_end|>", pad: str = "<|endoftext|>",
                    chat_template: str = CHAT_TEMPLATE):
    """Train a byte-level BPE tokenizer on a fixed corpus; returns a transformers tokenizer.

    ``special_tokens`` get the first ids, in order; ``bos``/``eos``/``pad`` name three of them,
    and ``chat_template`` is the Jinja template ``apply_chat_template`` renders.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad)
    fast.chat_template = chat_template
    return fast


def tiny_config(family: str, vocab_size: int, num_layers: int = 8, **overrides):
    """A small config of the given family: hidden 64, 4 heads, 2 KV heads (GQA) unless overridden."""
    from transformers import AutoConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    common.update(overrides)
    if family == "llama":
        return AutoConfig.for_model("llama", tie_word_embeddings=True, **common)
    if family == "qwen2":
        return AutoConfig.for_model("qwen2", tie_word_embeddings=False, **common)
    if family == "qwen3":
        return AutoConfig.for_model("qwen3", tie_word_embeddings=False, head_dim=16, **common)
    if family == "mistral":
        # A short sliding window, so prompts in tests actually exercise windowed attention.
        return AutoConfig.for_model("mistral", tie_word_embeddings=False, sliding_window=24, **common)
    raise ValueError(f"unknown tiny family {family!r}; choose from {TINY_FAMILIES}")


def build_tiny_model(family: str, out_dir: str | Path, seed: int = 0, num_layers: int = 8, **overrides) -> Path:
    """Write a seeded tiny model + tokenizer to ``out_dir`` (safetensors); returns the path.

    ``overrides`` change config fields (e.g. a wider hidden size for bandwidth-bound tests).
    """
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    tokenizer = build_tokenizer()
    config = tiny_config(family, len(tokenizer), num_layers, **overrides)
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def randomize_weights(model, seed: int) -> None:
    """Seeded weights with std 0.1 (norm weights around 1), so greedy argmax gaps are not fragile."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
