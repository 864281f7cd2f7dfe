"""Weight-only quantization of a shard's decoder layers (``p2pserve peer --quant int8|nf4|int4``).

Only the linear projections inside the decoder layers are quantized (q/k/v/o, the MLP's
gate/up/down, and every expert's gate/up/down in a routed-experts layer, which transformers holds as
fused 3-D tensors and `experts.unfuse_experts` first splits into one ``nn.Linear`` each; routers
stay at the compute dtype, as they are ``nn.Parameter`` matrices): the embeddings, the final norm and the LM head stay at the compute dtype, and
activations, the KV cache and the wire format are unchanged. Each scheme goes through the library
that measured best for it on CPU (``docs/quantization.md`` has the side-by-side table):

* ``int8``: torchao ``Int8WeightOnlyConfig`` (per-channel symmetric int8; fastest int8 kernel of
  torchao, bitsandbytes, optimum-quanto and HQQ on this CPU);
* ``int4``: torchao ``IntxWeightOnlyConfig(torch.int4, PerGroup(32))`` (torchao's packed int4
  layouts need CUDA or ARM; this one runs everywhere, but on x86 stores each value in an int8);
* ``nf4``: bitsandbytes ``Linear4bit(quant_type="nf4")`` (torchao's NF4 tensor runs on CPU at
  13x its time per token).

Both libraries come with the optional ``quant`` extra (``pip install 'p2pserve[quant]'``); without
it ``--quant`` is refused with a :class:`ConfigError` before anything loads. The scheme is part of
the model's swarm identity (:func:`with_quant`): ``NAME@int8`` is another model than ``NAME``, so
a route never mixes quantizations.
"""

from __future__ import annotations

import importlib
from typing import Optional

from p2pserve.errors import ConfigError
from p2pserve.model.experts import unfuse_experts

# scheme -> the module it needs (what `pip install 'p2pserve[quant]'` brings)
SCHEMES: dict[str, str] = {"int8": "torchao", "int4": "torchao", "nf4": "bitsandbytes"}
INT4_GROUP = 32  # int4 weights share one scale per 32 input columns
NF4_BLOCK = 64  # bitsandbytes' default NF4 block size
# Bytes per weight of a quantized projection, scales included, as measured on SmolLM2's layers
# (benchmarks/quantization.py): what a peer's layer budget counts. int4 on an x86 CPU is stored
# one value per int8 (torchao's packed int4 layouts need CUDA or ARM).
BYTES_PER_WEIGHT: dict[str, float] = {"int8": 1.01, "int4": 1.16, "nf4": 0.52}


def check_quant(quant: Optional[str]) -> Optional[str]:
    """The scheme ``--quant`` names (None for none/""), or a :class:`ConfigError` for an unknown
    name. A client asking for a scheme needs no library: only the peers compute."""
    if quant in (None, "", "none"):
        return None
    if quant not in SCHEMES:
        raise ConfigError(f"--quant {quant!r} is not a scheme; use one of none, {', '.join(SCHEMES)}")
    return quant


def require_backend(quant: Optional[str]) -> Optional[str]:
    """``check_quant``, and for a scheme, a :class:`ConfigError` unless its library imports here
    (the optional ``quant`` extra): a peer refuses ``--quant`` before it loads anything."""
    quant = check_quant(quant)
    if quant is None:
        return None
    module = SCHEMES[quant]
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"--quant {quant} needs {module}, which does not import here ({e}): "
                          f"pip install 'p2pserve[quant]'") from None
    return quant


def with_quant(name: str, quant: Optional[str]) -> str:
    """The swarm model name of ``name`` served at ``quant``: ``NAME@int8`` (``name`` itself
    without quantization; applying it twice changes nothing)."""
    if not quant or name.endswith("@" + quant):
        return name
    return f"{name}@{quant}"


def quantize_layers(layers, quant: Optional[str]) -> None:
    """Replace, in place, the weights of every ``nn.Linear`` inside ``layers`` (a shard's or a
    transformers model's decoder ``ModuleList``) by ``quant``'s weight-only form. The layers must
    already sit on their device; compute stays in the weights' original dtype. ``quant=None``
    leaves them as they are."""
    quant = require_backend(quant)
    if quant is None:
        return
    unfuse_experts(layers)  # routed experts -> one nn.Linear per expert and projection
    if quant == "nf4":
        _nf4(layers)
        return
    import torch
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    config = (Int8WeightOnlyConfig() if quant == "int8"
              else IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(INT4_GROUP)))
    quantize_(layers, config)


def _nf4(layers) -> None:
    """Swap each ``nn.Linear`` for a bitsandbytes ``Linear4bit`` holding NF4 blocks of its weight
    (``.to(device)`` is what quantizes it)."""
    import bitsandbytes as bnb
    import torch

    for parent in list(layers.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            w = child.weight
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=w.dtype, quant_type="nf4", device="meta")
            q.weight = bnb.nn.Params4bit(w.detach().to("cpu"), requires_grad=False, quant_type="nf4",
                                         blocksize=NF4_BLOCK)
            if child.bias is not None:
                q.bias = torch.nn.Parameter(child.bias.detach(), requires_grad=False)
            setattr(parent, child_name, q.to(w.device))


def weight_bytes(module) -> int:
    """Bytes the parameters and buffers of ``module`` hold, quantized tensors counted by their
    packed storage (what a layer costs in memory)."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        total += _tensor_bytes(t, seen)
    return total


def _tensor_bytes(t, seen: set) -> int:
    inner = getattr(t, "__tensor_flatten__", None)
    if inner is not None and type(t).__name__ not in ("Parameter", "Tensor"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n), seen) for n in names)
    total = 0
    state = getattr(t, "quant_state", None)  # bitsandbytes keeps absmax/code beside the packed bytes
    if state is not None and state.absmax is not None:
        total += state.absmax.numel() * state.absmax.element_size()
    ptr = t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)
    if ptr in seen:
        return total
    seen.add(ptr)
    return total + t.untyped_storage().nbytes()
