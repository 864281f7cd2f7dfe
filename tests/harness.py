"""Test helpers: real peer processes (from ``p2pserve.launch``) and the single-process oracle."""

from __future__ import annotations

from p2pserve.launch import PeerProcess, start_peers  # noqa: F401 - re-exported for tests


async def run_chain(model, hops, prompt_ids, params, max_length: int = 256, config=None) -> list[int]:
    """Generate through an explicit chain of hops with a fresh client node; returns the tokens."""
    from p2pserve.client.chain import create_client_p2p, open_chain_session
    from p2pserve.client.generation import generate
    from p2pserve.config import ClientConfig

    p2p = await create_client_p2p()
    try:
        session = await open_chain_session(p2p, hops, model, max_length, params, config or ClientConfig())
        try:
            return (await generate(session, prompt_ids, params, model.eos_ids)).tokens
        finally:
            await session.close()
    finally:
        await p2p.shutdown()


def reference_generate(model_path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from single-process transformers `generate` on the same weights (fp32)."""
    import torch

    model = _reference_model(model_path)
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )
    return out[0, len(prompt_ids):].tolist()


_MODELS: dict[str, object] = {}


def _reference_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    if path not in _MODELS:
        _MODELS[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _MODELS[path]
