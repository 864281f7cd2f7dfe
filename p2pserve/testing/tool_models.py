"""Tiny models that answer with a tool call in one of the formats the API parses.

Each is a real checkpoint (Qwen2 layout, fp32) whose weights make greedy decoding a fixed chain:
every layer's attention and MLP outputs are zeroed (``o_proj`` and ``down_proj`` are 0), so the
last hidden state is the current token's embedding, and the LM head maps the embedding of each
token of the chain to the next one. The chain starts at the last token of the chat template's
generation prompt and spells the format's tool call with tokens added for it, so any
conversation gets the same call back, through real peers, exactly as single-process
``generate`` would give it. The chat templates are small versions of the families' own: they
render the ``tools`` and earlier tool calls and results into the prompt.

Formats: ``hermes`` (Qwen's ``<tool_call>`` tags), ``llama3`` (Llama 3.x's bare JSON with
``parameters``), ``harmony`` (GPT-OSS's channels, with its special tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TOOL_FORMATS = ("hermes", "llama3", "harmony")

#: The call every tool model makes.
CALL_NAME = "get_weather"
CALL_ARGUMENTS = {"city": "Paris"}

_HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions:\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "Answer a call as <tool_call>\n{\"name\": <name>, \"arguments\": <arguments>}\n</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>\n"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_LLAMA3_TEMPLATE = (
    "<|begin_of_text|>{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    "Answer a call as {\"name\": function name, \"parameters\": arguments}.\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", "
    "\"parameters\": {{ c.function.arguments | tojson }}}{% endfor %}{% else %}{{ m.content }}{% endif %}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
_HARMONY_TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n"
    "{% for t in tools %}// {{ t.function.description }}\ntype {{ t.function.name }} = "
    "(_: {{ t.function.parameters | tojson }}) => any;\n{% endfor %}} // namespace functions<|end|>{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>commentary"
    "<|message|>{{ m.content }}<|end|>{% elif m.tool_calls %}{% for c in m.tool_calls %}<|start|>assistant"
    "<|channel|>commentary to=functions.{{ c.function.name }} <|constrain|>json<|message|>"
    "{{ c.function.arguments | tojson }}<|call|>{% endfor %}{% else %}<|start|>{{ m.role }}<|message|>"
    "{{ m.content }}<|end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
_ARGS = json.dumps(CALL_ARGUMENTS)

# (special tokens, eos names, template, the generated chain: (text, special) pieces)
_FORMATS = {
    "hermes": (("<|endoftext|>", "<|im_start|>", "<|im_end|>"), ("<|im_end|>",), _HERMES_TEMPLATE,
               [("<tool_call>\n", False), (json.dumps({"name": CALL_NAME, "arguments": CALL_ARGUMENTS}), False),
                ("\n</tool_call>", False), ("<|im_end|>", True)]),
    "llama3": (("<|end_of_text|>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|python_tag|>"), ("<|eot_id|>",), _LLAMA3_TEMPLATE,
               [(json.dumps({"name": CALL_NAME, "parameters": CALL_ARGUMENTS}), False), ("<|eot_id|>", True)]),
    "harmony": (("<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                 "<|call|>", "<|return|>"), ("<|call|>", "<|return|>"), _HARMONY_TEMPLATE,
                [("<|channel|>", True), (f"commentary to=functions.{CALL_NAME} ", False), ("<|constrain|>", True),
                 ("json", False), ("<|message|>", True), (_ARGS, False), ("<|call|>", True)]),
}


def build_tool_model(fmt: str, out_dir: str | Path, seed: int = 0, num_layers: int = 4) -> Path:
    """Write the tiny model answering in ``fmt`` (one of :data:`TOOL_FORMATS`) to ``out_dir``."""
    from tokenizers import AddedToken
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from p2pserve.model.tiny import build_tokenizer

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    specials, eos, template, chain = _FORMATS[fmt]
    tok = build_tokenizer(special_tokens=specials, bos=None, eos=eos[0], pad=specials[0], chat_template=template)
    tok.add_tokens([AddedToken(text, normalized=False, special=False) for text, special in chain if not special])
    start = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    start = start["input_ids"] if not isinstance(start, list) else start
    ids = [start[-1]] + [tok.convert_tokens_to_ids(text) for text, _ in chain]
    if len(set(ids)) != len(ids):
        raise ValueError(f"the {fmt} chain repeats a token: {ids}")
    config = AutoConfig.for_model("qwen2", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                  bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids(eos[0]),
                                  pad_token_id=tok.pad_token_id)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif "o_proj" in name or "down_proj" in name:
                p.zero_()  # every layer adds nothing: the last hidden state is the token's embedding
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        emb = model.model.embed_tokens.weight  # [V, H]
        head = model.lm_head.weight  # [V, H]
        for a, b in zip(ids, ids[1:]):
            head[b] = 5.0 * emb[a] / emb[a].norm()  # the logit of b dominates wherever a is the input
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    GenerationConfig(eos_token_id=[tok.convert_tokens_to_ids(e) for e in eos], bos_token_id=None,
                     pad_token_id=tok.pad_token_id).save_pretrained(out)
    return out
