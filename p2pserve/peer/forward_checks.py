"""What a peer checks on a Forward before it runs: its inputs, positions and outputs, against the
session it names. Pure: every failure is a :class:`~p2pserve.errors.BadRequestError` that the
handler answers with a typed error, and nothing has touched the session's cache yet."""

from __future__ import annotations

import torch

from p2pserve.errors import BadRequestError
from p2pserve.model.spec import ModelSpec
from p2pserve.protocol import Forward


def check_forward(spec: ModelSpec, session, msg: Forward, inputs: torch.Tensor) -> None:
    """Raise unless ``inputs`` (decoded from ``msg``'s payload) may run on ``session`` (a peer
    ``Session``): their type and shape, their positions inside the session, and ``msg.outputs``."""
    check_inputs(spec, session, inputs)
    n = inputs.shape[0]
    if msg.position > session.position:
        raise BadRequestError(
            f"position {msg.position} skips ahead of the session's {session.position} cached tokens"
        )
    if msg.position + n > session.max_length:
        raise BadRequestError(
            f"positions up to {msg.position + n} exceed the session's max_length {session.max_length}"
        )
    # The decoder bounded outputs to [1, MAX_VERIFY_OUTPUTS]; it must also fit this Forward, and only
    # the last hop has logits to return tokens from.
    if msg.outputs > n or (msg.outputs > 1 and session.end != spec.num_layers):
        raise BadRequestError(
            f"outputs={msg.outputs} needs a span ending at the last layer and at least that many tokens "
            f"(this span ends at layer {session.end} of {spec.num_layers}, the Forward carries {n})"
        )


def check_inputs(spec: ModelSpec, session, inputs: torch.Tensor) -> None:
    """Token ids int64 [n] in the vocabulary for a span starting at layer 0, else finite hidden
    states [n, hidden] in the model's dtype; n >= 1."""
    if session.start == 0:
        if inputs.dtype != torch.int64 or inputs.dim() != 1:
            raise BadRequestError(
                f"a span starting at layer 0 takes token ids int64 [n], got {inputs.dtype} {list(inputs.shape)}"
            )
        if inputs.numel() and (int(inputs.min()) < 0 or int(inputs.max()) >= spec.vocab_size):
            raise BadRequestError(f"token ids must be in [0, {spec.vocab_size})")
    else:
        expected = str(inputs.dtype).removeprefix("torch.")
        if inputs.dim() != 2 or inputs.shape[1] != spec.hidden_size:
            raise BadRequestError(f"hidden states must be [n, {spec.hidden_size}], got {list(inputs.shape)}")
        if expected != spec.dtype:
            raise BadRequestError(f"hidden states must be {spec.dtype}, got {expected}")
        if not bool(torch.isfinite(inputs).all()):  # refused here, not passed down the chain
            raise BadRequestError("hidden states must be finite (they hold NaN or inf)")
    if inputs.shape[0] == 0:
        raise BadRequestError("a Forward must carry at least one token")
