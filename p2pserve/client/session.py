"""An inference session over a chain of hops, driven by the client.

The client sends token ids to the first hop, passes each hop's hidden states to the next, and
receives the sampled token from the last; then repeats with that token. Why client-driven and
not peer-to-peer forwarding is measured and argued in ARCHITECTURE.md ("Hop topology").

The session keeps the full token history (prompt and generated), so a caller can replay it on
another chain after a failure (``p2pserve.client.failover``).
"""

from __future__ import annotations

import asyncio
import uuid

import torch

from p2pserve.client.connection import Hop, HopConnection
from p2pserve.config import ClientConfig
from p2pserve.errors import BadRequestError, RoutingError
from p2pserve.protocol import SamplingParams
from p2pserve.transport import tensor_to_wire


def check_chain(hops: list[Hop], num_layers: int) -> None:
    """Raise RoutingError unless hops cover [0, num_layers) contiguously."""
    if not hops:
        raise RoutingError("empty chain")
    at = 0
    for hop in hops:
        if hop.start != at or hop.end <= hop.start:
            raise RoutingError(f"chain is not contiguous at layer {at}: {' -> '.join(map(str, hops))}")
        at = hop.end
    if at != num_layers:
        raise RoutingError(f"chain ends at layer {at}, the model has {num_layers}")


class InferenceSession:
    """One generation session through a fixed chain of peers."""

    def __init__(
        self,
        p2p,
        hops: list[Hop],
        model_id: str,
        num_layers: int,
        max_length: int,
        sampling: SamplingParams = SamplingParams(),
        config: ClientConfig = ClientConfig(),
        session_id: str | None = None,
    ):
        check_chain(hops, num_layers)
        self.p2p = p2p
        self.hops = list(hops)
        self.model_id = model_id
        self.max_length = max_length
        self.sampling = sampling
        self.config = config
        self.session_id = session_id or uuid.uuid4().hex
        self.connections = [
            HopConnection(p2p, h, config.frame_limits, config.hop_timeout_s, config.direct, config.direct_connect_timeout_s)
            for h in hops
        ]
        self.position = 0  # tokens the peers have cached
        self.history: list[int] = []  # every token id sent, in order (for replay)
        self.step_count = 0

    async def __aenter__(self) -> "InferenceSession":
        await self.open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def open(self) -> None:
        """Open a stream and a session on every hop (in parallel)."""
        await asyncio.gather(
            *(c.open(self.model_id, self.session_id, self.max_length, self.sampling) for c in self.connections)
        )

    async def step(self, token_ids: list[int]) -> int:
        """Feed tokens at the current position through the chain; return the next token."""
        if not token_ids:
            raise BadRequestError("step needs at least one token")
        if self.position + len(token_ids) > self.max_length:
            raise BadRequestError(f"session would exceed max_length {self.max_length}")
        meta, data = tensor_to_wire(torch.tensor(token_ids, dtype=torch.int64))
        step = self.step_count
        token = None
        for conn in self.connections:
            reply, payload = await conn.forward_wire(step, self.position, meta, data)
            if reply.tensor is not None:  # hidden states: handed to the next hop as received
                meta, data = reply.tensor, payload
            token = reply.token
        self.step_count += 1
        self.position += len(token_ids)
        self.history.extend(token_ids)
        if token is None:
            raise RoutingError("the last hop returned hidden states instead of a token")
        return int(token)

    def rewind(self, position: int) -> None:
        """Make the next step start at ``position`` (peers drop later cache entries)."""
        if not (0 <= position <= self.position):
            raise BadRequestError(f"cannot rewind to {position}; session holds {self.position} tokens")
        self.position = position
        del self.history[position:]

    async def close(self) -> None:
        """Close every hop's session and stream."""
        await asyncio.gather(*(c.close() for c in self.connections), return_exceptions=True)
