"""Real checkpoints' config.json and generation_config.json facts, one per supported family.

Each entry is the published configuration of one model on the Hugging Face hub, in the hub's own
format (``rope_scaling``/``rope_theta`` keys, ``torch_dtype``), written here as facts so that
`tiny_families` can build small random models with the same rope settings, attention layout,
biases, norms and tie flags, and tests read folders shaped like the real ones. Token ids are the
real ones; the tiny builder maps them to its own tokenizer by the tokens' names (``tokens``).
The chat templates are short templates of each family's prompt format (not the full
tool-calling templates the hub ships).
"""

from __future__ import annotations

# Llama 3.2 1B Instruct: GQA 32:8, head_dim 64, tied embeddings, rope_type llama3.
LLAMA_3_2_1B_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}

# Qwen2.5 0.5B Instruct: GQA 14:2, q/k/v biases, rope_theta 1e6, tied, sliding window off.
QWEN2_5_0_5B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# Qwen3 0.6B: per-head q/k RMSNorm, head_dim 128 decoupled from hidden 1024 / 16 heads, GQA 16:8.
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# Mistral 7B Instruct v0.3: GQA 32:8, head_dim 128, untied. v0.3 has no sliding window; the
# v0.1 checkpoints had sliding_window 4096, which the tiny builder keeps (scaled) so that
# windowed attention is exercised.
MISTRAL_7B_INSTRUCT_V0_3 = {
    "architectures": ["MistralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32768,
}
MISTRAL_V0_1_SLIDING_WINDOW = 4096

# Phi-3.5 mini instruct (model_type phi3): fused qkv_proj and gate_up_proj, 32 heads of 96 with
# no GQA, longrope scaling from 4096 to 131072 positions (48 = head_dim / 2 factors each).
PHI_3_5_MINI_INSTRUCT = {
    "architectures": ["Phi3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "embd_pdrop": 0.0,
    "eos_token_id": 32000,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "model_type": "phi3",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096,
    "pad_token_id": 32000,
    "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "long_factor": [
            1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601,
            1.5899999141693115, 1.600000023841858, 1.6200000047683716, 2.620000123977661,
            3.2300000190734863, 3.2300000190734863, 4.789999961853027, 7.400000095367432,
            7.700000286102295, 9.09000015258789, 12.199999809265137, 17.670000076293945,
            24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
            32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992,
            50.340003967285156, 50.45000457763672, 57.55000305175781, 57.93000411987305,
            58.21000289916992, 60.1400032043457, 62.61000442504883, 62.62000274658203,
            62.71000289916992, 63.1400032043457, 63.1400032043457, 63.77000427246094,
            63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
            64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938,
            64.4800033569336, 64.51000213623047, 64.52999877929688, 64.83999633789062,
        ],
        "short_factor": [
            1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705,
            1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842,
            1.0499999523162842, 1.0699999332427979, 1.0999999046325684, 1.1099998950958252,
            1.1599998474121094, 1.1599998474121094, 1.1699998378753662, 1.2899998426437378,
            1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083,
            1.8499997854232788, 1.8799997568130493, 1.9099997282028198, 1.9399996995925903,
            1.9899996519088745, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
            2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0299997329711914,
            2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
            2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
            2.0799996852874756, 2.0899996757507324, 2.189999580383301, 2.2199995517730713,
            2.5899994373321533, 2.729999542236328, 2.749999523162842, 2.8399994373321533,
        ],
        "type": "longrope",
    },
    "rope_theta": 10000.0,
    "sliding_window": 262144,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32064,
}

# Phi-3 mini 4k instruct: the same layout without rope scaling, and a sliding window of 2047.
PHI_3_MINI_4K_INSTRUCT = {
    **{k: v for k, v in PHI_3_5_MINI_INSTRUCT.items() if k != "rope_scaling"},
    "max_position_embeddings": 4096,
    "rope_scaling": None,
    "sliding_window": 2047,
}

# Qwen3 30B-A3B (model_type qwen3_moe): Qwen3's attention (per-head q/k RMSNorm, head_dim 128,
# GQA 32:4) with 128 routed experts of width 768 per layer, 8 per token, top-k weights renormalised.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# Mixtral 8x7B Instruct v0.1: Mistral's attention (GQA 32:8, head_dim 128) with 8 routed experts
# of width 14336 per layer, 2 per token; checkpoints name the experts block_sparse_moe.experts.{e}.w1/w2/w3.
MIXTRAL_8X7B_INSTRUCT_V0_1 = {
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32000,
}

# GLM-4.5 (355B-A32B, model_type glm4_moe): 160 routed experts of width 1536, 8 per token, chosen by
# sigmoid scores with a correction bias and scaled by 2.5, plus one shared expert every token runs;
# the first 3 layers dense; q/k/v biases, per-head q/k RMSNorm, rotary on half of each 128-wide head.
# Its checkpoints also hold one multi-token-prediction layer after the last (num_nextn_predict_layers),
# which serving ignores.
GLM_4_5 = {
    "architectures": ["Glm4MoeForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "pad_token_id": 151329,
    "eos_token_id": [151329, 151336, 151338],
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "partial_rotary_factor": 0.5,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 131072,
    "model_type": "glm4_moe",
    "moe_intermediate_size": 1536,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "n_group": 1,
    "topk_group": 1,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "num_hidden_layers": 92,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_qk_norm": True,
    "vocab_size": 151552,
}

# gpt-oss-20b (model_type gpt_oss): 24 layers alternating a 128-token sliding window and full
# attention, each head with a learned attention sink; q/k/v/o biases, GQA 64:8 with head_dim 64;
# YaRN rope (factor 32 over 4096 original positions, theta 150000); 32 routed experts of width
# 2880, 4 per token, with biases, a router with a bias (softmax over the top-k logits) and a
# clamped SwiGLU (swiglu_limit 7). The hub stores the experts in MXFP4 (quantization_config).
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 201088,
}

# DeepSeek-V3 (671B-A37B, model_type deepseek_v3): multi-head latent attention (128 heads; q through a
# rank-1536 bottleneck; keys and values expanded from one cached latent of 512 plus a 64-wide rotary
# key shared by every head; qk head 128 + 64, value head 128), YaRN rope (factor 40 over 4096
# positions, mscale folded into the softmax scale), rotary dims interleaved in pairs; 256 routed
# experts of width 2048, 8 per token chosen in groups (8 groups, the best 4 by the sum of their top-2
# sigmoid scores plus a correction bias), scaled by 2.5, plus one shared expert; the first 3 layers
# dense. The hub checkpoint stores block-FP8 weights (``quantization_config``), which p2pserve
# refuses (a bf16 conversion serves); the tiny copies leave it out. Its multi-token-prediction layer
# after the last (num_nextn_predict_layers) is not served.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

# Gemma 2 2B it: a family this version does not run (tests check the refusal names it).
GEMMA_2_2B_IT = {
    "architectures": ["Gemma2ForCausalLM"],
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "max_position_embeddings": 8192,
    "model_type": "gemma2",
    "num_attention_heads": 8,
    "num_hidden_layers": 26,
    "num_key_value_heads": 4,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "vocab_size": 256000,
}

_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_MISTRAL_INST = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}"
                 "{{ eos_token }}{% else %}[INST] {{ m['content'] }}[/INST]{% endif %}{% endfor %}")

# name -> (hub id, config.json, generation_config.json, tokens: real id -> token text, the
# tokenizer's bos/eos/pad token texts, chat template)
FAMILIES: dict[str, dict] = {
    "llama3": dict(
        hub="meta-llama/Llama-3.2-1B-Instruct", config=LLAMA_3_2_1B_INSTRUCT,
        generation={"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128008, 128009],
                    "temperature": 0.6, "top_p": 0.9},
        tokens={128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128006: "<|start_header_id|>",
                128007: "<|end_header_id|>", 128008: "<|eom_id|>", 128009: "<|eot_id|>"},
        bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|end_of_text|>",
        template=("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                  "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
                  "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    ),
    "qwen2.5": dict(
        hub="Qwen/Qwen2.5-0.5B-Instruct", config=QWEN2_5_0_5B_INSTRUCT,
        generation={"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True,
                    "eos_token_id": [151645, 151643], "repetition_penalty": 1.1, "temperature": 0.7,
                    "top_p": 0.8, "top_k": 20},
        tokens={151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"},
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", template=_CHATML,
    ),
    "qwen3": dict(
        hub="Qwen/Qwen3-0.6B", config=QWEN3_0_6B,
        generation={"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                    "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95},
        tokens={151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>", 151667: "<think>",
                151668: "</think>"},
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", template=_CHATML,
    ),
    "mistral": dict(
        hub="mistralai/Mistral-7B-Instruct-v0.3", config=MISTRAL_7B_INSTRUCT_V0_3,
        generation={"bos_token_id": 1, "eos_token_id": 2},
        tokens={0: "<unk>", 1: "<s>", 2: "</s>", 3: "[INST]", 4: "[/INST]"},
        bos="<s>", eos="</s>", pad="<unk>", template=_MISTRAL_INST,
    ),
    "phi3.5": dict(
        hub="microsoft/Phi-3.5-mini-instruct", config=PHI_3_5_MINI_INSTRUCT,
        generation={"bos_token_id": 1, "eos_token_id": [32007, 32001, 32000], "pad_token_id": 32000},
        tokens={0: "<unk>", 1: "<s>", 2: "</s>", 32000: "<|endoftext|>", 32001: "<|assistant|>",
                32006: "<|system|>", 32007: "<|end|>", 32010: "<|user|>"},
        bos="<s>", eos="<|endoftext|>", pad="<|endoftext|>",
        template=("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    ),
}
FAMILIES["phi3-4k"] = dict(FAMILIES["phi3.5"], hub="microsoft/Phi-3-mini-4k-instruct", config=PHI_3_MINI_4K_INSTRUCT,
                           generation={"bos_token_id": 1, "eos_token_id": [32000, 32001, 32007], "pad_token_id": 32000})
FAMILIES["qwen3-moe"] = dict(FAMILIES["qwen3"], hub="Qwen/Qwen3-30B-A3B", config=QWEN3_30B_A3B)
FAMILIES["mixtral"] = dict(
    hub="mistralai/Mixtral-8x7B-Instruct-v0.1", config=MIXTRAL_8X7B_INSTRUCT_V0_1,
    generation={"bos_token_id": 1, "eos_token_id": 2},
    tokens={0: "<unk>", 1: "<s>", 2: "</s>"}, bos="<s>", eos="</s>", pad="<unk>", template=_MISTRAL_INST,
)
FAMILIES["glm4.5"] = dict(
    hub="zai-org/GLM-4.5", config=GLM_4_5,
    generation={"eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329},
    tokens={151329: "<|endoftext|>", 151331: "[gMASK]", 151333: "<sop>", 151335: "<|system|>", 151336: "<|user|>",
            151337: "<|assistant|>", 151338: "<|observation|>"},
    bos=None, eos="<|user|>", pad="<|endoftext|>",
    template=("[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
)
FAMILIES["gpt-oss"] = dict(
    hub="openai/gpt-oss-20b", config=GPT_OSS_20B,
    generation={"bos_token_id": 199998, "do_sample": True, "eos_token_id": [200002, 199999, 200012],
                "pad_token_id": 199999},
    tokens={199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200005: "<|channel|>",
            200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>"},
    bos="<|startoftext|>", eos="<|return|>", pad="<|endoftext|>",
    # The harmony format, without its system preamble and channels.
    template=("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
              "{% if add_generation_prompt %}<|start|>assistant{% endif %}"),
)
FAMILIES["deepseek-v3"] = dict(
    hub="deepseek-ai/DeepSeek-V3", config=DEEPSEEK_V3,
    generation={"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95},
    tokens={0: "<｜begin▁of▁sentence｜>", 1: "<｜end▁of▁sentence｜>", 2: "<｜▁pad▁｜>", 128803: "<｜User｜>",
            128804: "<｜Assistant｜>"},
    bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", pad="<｜▁pad▁｜>",
    template=("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
              "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
              "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"),
)
