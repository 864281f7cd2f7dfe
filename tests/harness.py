"""Test helpers: real peer processes (from ``p2pserve.launch``), a client transport per test, and
the single-process oracle."""

from __future__ import annotations

from contextlib import asynccontextmanager

from p2pserve.launch import PeerProcess, start_peers  # noqa: F401 - re-exported for tests


@asynccontextmanager
async def client_node(config=None):
    """A client transport (its own libp2p node, the direct path per ``config``), closed on exit."""
    from p2pserve.client.node import client_transport
    from p2pserve.config import ClientConfig

    transport = await client_transport(config or ClientConfig())
    try:
        yield transport
    finally:
        await transport.close()


async def open_chain_pipeline(transport, hops, model, max_length, params, config=None):
    """An opened pipeline over the explicit chain ``hops`` with sampling taken from ``params``."""
    from p2pserve.client.pipeline import open_chain
    from p2pserve.config import ClientConfig

    spec = model.spec
    return await open_chain(transport, hops, spec.model_id, spec.num_layers, max_length, params.validate(),
                            config or ClientConfig())


async def run_chain(model, hops, prompt_ids, params, max_length: int = 256, config=None) -> list[int]:
    """Generate through an explicit chain of hops with a fresh client node; returns the tokens."""
    from p2pserve.client.generation import generate

    async with client_node(config) as transport:
        pipeline = await open_chain_pipeline(transport, hops, model, max_length, params, config)
        try:
            return (await generate(pipeline, prompt_ids, params, model.eos_ids)).tokens
        finally:
            await pipeline.close()


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


def tiny_session_table(directory, num_layers: int = 2):
    """A real tiny Llama checkpoint under ``directory`` and a ``SessionTable`` serving all of it:
    ``(path, spec, budget, table)`` (KV budget of 1M token-layers, fp32)."""
    import torch

    from p2pserve.model.spec import load_spec
    from p2pserve.model.tiny import build_tiny_model
    from p2pserve.peer.kv_cache import KVBudget
    from p2pserve.peer.sessions import SessionTable

    path = str(build_tiny_model("llama", directory, num_layers=num_layers))
    spec = load_spec(path)
    budget = KVBudget(1_000_000)
    table = SessionTable(spec=spec, served=(0, spec.num_layers), budget=budget, idle_timeout_s=60.0,
                         torch_dtype=torch.float32)
    return path, spec, budget, table


def open_session(table, name: str, owner=None, start: int = 0, sampling=None, max_length: int = 16):
    """Open session ``name`` on ``table`` over layers [start, last) for ``owner``."""
    from p2pserve.protocol import PROTOCOL_VERSION, OpenSession, SamplingParams

    spec = table.spec
    return table.open(OpenSession(version=PROTOCOL_VERSION, model_id=spec.model_id, session_id=name, start=start,
                                  end=spec.num_layers, max_length=max_length,
                                  sampling=sampling if sampling is not None else SamplingParams()), owner=owner)
