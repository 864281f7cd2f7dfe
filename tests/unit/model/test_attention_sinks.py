"""Attention sinks (GPT-OSS) against transformers' own eager GPT-OSS attention, and on padding rows."""

from __future__ import annotations

import torch

from p2pserve.model.attention import attention_mask, sdpa


def test_sink_attention_matches_transformers_eager_gpt_oss_attention():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 16, generator=gen) for h, n in ((8, 5), (2, 12), (2, 12)))
    sinks = torch.randn(8, generator=gen)
    for window in (None, 4):
        mask = attention_mask(5, 12, window, "cpu")  # [5, 12] bool, True: attend
        module = torch.nn.Module()
        module.num_key_value_groups, module.sinks, module.training = 4, sinks, False
        additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)[None, None]
        want, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.25)  # [1, n, nH, D]
        got = sdpa(q, k, v, mask, 0.25, sinks)  # [1, nH, n, D]
        torch.testing.assert_close(got.transpose(1, 2), want, rtol=1e-6, atol=1e-6)


def test_a_fully_masked_row_puts_its_mass_on_the_sink():
    q, k, v = torch.ones(1, 2, 1, 4), torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 4)
    out = sdpa(q, k, v, torch.zeros(1, 3, dtype=torch.bool), 1.0, torch.zeros(2))
    assert torch.equal(out, torch.zeros_like(out))
