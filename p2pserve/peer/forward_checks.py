"""What a peer checks on a Forward before it runs: its inputs, positions and outputs, against the
session it names. Pure: every failure is a :class:`~p2pserve.errors.BadRequestError` that the
handler answers with a typed error, and nothing has touched the session's cache yet."""

from __future__ import annotations

import torch

from p2pserve.errors import BadRequestError
from p2pserve.model.spec import ModelSpec
from p2pserve.peer.sampling import Ask, mask_words
from p2pserve.protocol import Forward

#: The most fp32 logits bytes a Forward asking for prompt log-probabilities may make the last hop hold.
MAX_PROMPT_LOGITS_BYTES = 256 << 20


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


def last_hop_ask(spec: ModelSpec, session, msg: Forward, n: int) -> Ask | None:
    """Check a Forward's last-hop fields (``context``, ``prompt_logprobs``, ``allowed``) and
    advance the session's token history with ``context``; the job's :class:`Ask`, or None when
    the Forward asks nothing beyond a plain token. Raises before anything runs."""
    last = session.end == spec.num_layers
    extras = msg.context is not None or msg.prompt_logprobs or msg.allowed is not None
    if extras and not last:
        raise BadRequestError("context, prompt_logprobs and allowed are for the hop holding the last layer")
    if not last:
        return None
    sampling = session.sampling
    if msg.context is not None:
        if len(msg.context) != n:
            raise BadRequestError(f"context must hold the Forward's {n} token ids, got {len(msg.context)}")
        if any(t >= spec.vocab_size for t in msg.context):
            raise BadRequestError(f"context token ids must be in [0, {spec.vocab_size})")
        if len(session.tokens) < msg.position:
            raise BadRequestError(f"the session's token history stops at {len(session.tokens)}; send context "
                                  f"from there (this Forward starts at {msg.position})")
        del session.tokens[msg.position:]
        session.tokens.extend(msg.context)
    elif sampling.needs_history or msg.prompt_logprobs:
        raise BadRequestError("this session's penalties and prompt_logprobs need the Forward's context")
    if msg.prompt_logprobs and msg.outputs != 1:
        raise BadRequestError("prompt_logprobs takes outputs=1")
    if msg.prompt_logprobs and n * spec.vocab_size * 4 > MAX_PROMPT_LOGITS_BYTES:
        # the job holds the fp32 logits of every row until it is scored: bounded per Forward
        raise BadRequestError(f"prompt_logprobs over {n} tokens needs more than {MAX_PROMPT_LOGITS_BYTES >> 20} MiB "
                              f"of logits; at most {MAX_PROMPT_LOGITS_BYTES // (4 * spec.vocab_size)} tokens")
    if msg.allowed is not None and (len(msg.allowed) != 4 * mask_words(spec.vocab_size) or msg.outputs != 1):
        raise BadRequestError(f"allowed must be a bitmask of {4 * mask_words(spec.vocab_size)} bytes, with outputs=1")
    if sampling.logit_bias and any(t >= spec.vocab_size for t, _ in sampling.logit_bias):
        raise BadRequestError(f"logit_bias token ids must be in [0, {spec.vocab_size})")
    if msg.context is None and msg.allowed is None and not sampling.logprobs:
        return None
    history = session.tokens if msg.context is not None else None
    return Ask(history=history, allowed=msg.allowed, prompt_rows=n - 1 if msg.prompt_logprobs else 0)
