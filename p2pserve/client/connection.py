"""One client-side stream to one peer, carrying one session hop.

The stream comes from a :class:`~p2pserve.transport.Transport` (libp2p, upgraded to the direct
TCP path when the transport does that, or in-memory pipes in tests): this module never sees
what carries the bytes. Every call sends a frame and waits for its reply under a timeout; a
typed ``ErrorReply`` is raised as the matching class of ``errors.ERROR_CLASSES``, naming the peer.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Optional

import numpy as np
import torch

from p2pserve.client.hop import Hop
from p2pserve.dtypes import EXPONENT_MASKS
from p2pserve.errors import MalformedFrameError
from p2pserve.protocol import (
    PROTOCOL_VERSION,
    CloseSession,
    Forward,
    ForwardResult,
    FrameLimits,
    GetStats,
    OpenSession,
    PeerStats,
    SamplingParams,
    SessionOpened,
    TensorMeta,
)
from p2pserve.transport import Stream, Transport
from p2pserve.transport.frames import tensor_from_wire, tensor_to_wire
from p2pserve.transport.session_stream import SessionStream, open_session_stream


class HopConnection(SessionStream):
    """A session stream to one peer carrying one hop: open, forward, close.

    ``timeout_s`` bounds every round trip (a prefill included); ``connect_timeout_s`` bounds
    dialling the peer and opening the stream. ``stream`` and ``session_id`` make it carry a
    session already open on another connection's stream (a verifier's witness replays).
    """

    def __init__(self, transport: Transport, hop: Hop, limits: FrameLimits, timeout_s: float,
                 connect_timeout_s: float = 20.0, *, stream: Optional[Stream] = None,
                 session_id: Optional[str] = None):
        super().__init__(hop.peer_id, limits, timeout_s, stream=stream, label=str(hop))
        self.transport = transport
        self.hop = hop
        self.connect_timeout_s = connect_timeout_s
        self.session_id: Optional[str] = session_id
        self.opened: Optional[SessionOpened] = None
        self.open_rtt_s: Optional[float] = None

    async def connect(self) -> None:
        """Open the stream (dialling the hop's addresses first) without opening a session."""
        self.attach(await open_session_stream(self.transport, self.hop.peer_id, self.hop.maddrs,
                                              self.connect_timeout_s))

    async def open(self, model_id: str, session_id: Optional[str], max_length: int,
                   sampling: SamplingParams, fork: Optional[tuple[str, int]] = None) -> SessionOpened:
        """Open the stream and the session on the peer.

        ``session_id`` None draws a fresh random one: each hop gets its own, so one hop's id
        tells nothing about another's (the peer also binds a session to the stream that opened it).
        ``fork`` (session id, positions) starts the session holding that many positions of
        another session of this client on the same hop (``OpenSession.fork_of``).
        """
        await self.connect()
        session_id = session_id or secrets.token_hex(16)
        fork_of, fork_at = fork if fork is not None else (None, 0)
        msg = OpenSession(version=PROTOCOL_VERSION, model_id=model_id, session_id=session_id, start=self.hop.start,
                          end=self.hop.end, max_length=max_length, sampling=sampling, fork_of=fork_of, fork_at=fork_at)
        t0 = time.perf_counter()
        reply, _ = await self.call(msg)
        self.open_rtt_s = time.perf_counter() - t0  # no compute behind it: the link's RTT (client/trust/observer.py)
        if not isinstance(reply, SessionOpened):
            raise MalformedFrameError(f"expected SessionOpened from {self.hop}, got {type(reply).__name__}")
        self.session_id, self.opened = session_id, reply
        return reply

    def hidden_of(self, reply, payload: bytes, n: int) -> Optional[TensorMeta]:
        """Check a reply to a Forward of ``n`` positions; returns its hidden states' header, if any.

        A pipeline passes one hop's hidden states to the next as the bytes it received, never
        decoding them into a tensor: a prefill's activations are copied once less per hop. They
        are checked here against the shape and dtype this hop must return ([n, hidden] in the
        model's dtype), so a malformed answer is blamed on the hop that sent it (retriable),
        not on the next hop that would refuse it.
        """
        if not isinstance(reply, ForwardResult):
            raise MalformedFrameError(f"expected ForwardResult from {self.hop}, got {type(reply).__name__}")
        if reply.tensor is None:
            return None
        reply.tensor.validate(len(payload))
        if self.opened is not None:
            want = [n, self.opened.hidden_size]
            if list(reply.tensor.shape) != want or reply.tensor.dtype != self.opened.dtype:
                raise MalformedFrameError(
                    f"{self.hop} returned hidden states {reply.tensor.dtype} {list(reply.tensor.shape)}, "
                    f"expected {self.opened.dtype} {want}"
                )
        return reply.tensor

    def check_forward(self, reply, payload: bytes, n: int, step: int, position: int, last: bool,
                      vocab_size: Optional[int] = None, outputs: int = 1) -> Optional[TensorMeta]:
        """Check a reply to ``Forward(step, position)`` of ``n`` positions in full; returns its
        hidden states' header (None from the ``last`` hop, which returns a token).

        Whatever a peer returns is hostile until checked: the step and position it answers, a
        tensor from a hop before the last (without it the client would pass the previous hop's
        activations on and skip this hop's layers), a token in ``[0, vocab_size)`` from the last
        (``outputs`` > 1: exactly that many ``tokens``, each in the vocabulary), and finite hidden
        states. Each failure is a ``MalformedFrameError`` blamed on this hop.
        """
        meta = self.hidden_of(reply, payload, n)
        if reply.step != step or reply.position != position + n:
            raise MalformedFrameError(
                f"{self.hop} answered step {reply.step} at position {reply.position}, "
                f"expected step {step} at position {position + n}"
            )
        if last:
            tokens = [reply.token] if outputs == 1 else reply.tokens
            if meta is not None or tokens is None or None in tokens or len(tokens) != outputs:
                raise MalformedFrameError(f"{self.hop} holds the last layer but did not return {outputs} token(s)")
            if vocab_size is not None and max(tokens) >= vocab_size:  # the decoder made sure they are >= 0
                raise MalformedFrameError(f"{self.hop} returned token {max(tokens)}, outside the vocabulary")
            return None
        if meta is None:
            raise MalformedFrameError(f"{self.hop} returned no hidden states for layers [{self.hop.start}, {self.hop.end})")
        if not all_finite(meta.dtype, payload):
            raise MalformedFrameError(f"{self.hop} returned hidden states that are not finite")
        return meta

    async def forward(self, step: int, position: int, inputs: torch.Tensor) -> tuple[ForwardResult, Optional[torch.Tensor]]:
        """Send inputs for [position, position + n); returns (result, hidden states or None)."""
        meta, data = tensor_to_wire(inputs)
        reply, payload = await self.call(Forward(session_id=self.session_id, step=step, position=position, tensor=meta),
                                         data)
        hidden = self.hidden_of(reply, payload, inputs.shape[0])
        return reply, (tensor_from_wire(hidden, payload) if hidden is not None else None)

    async def stats(self) -> PeerStats:
        """Ask the peer for its load counters."""
        if self.stream is None:
            await self.connect()
        reply, _ = await self.call(GetStats())
        return reply

    async def close(self) -> None:
        """Close the session (best effort) and the stream."""
        if self.stream is None:
            return
        try:
            if self.session_id is not None:
                await asyncio.wait_for(self.call(CloseSession(session_id=self.session_id)), 2.0)
        except Exception:  # the peer may be dead; closing is best effort
            pass
        self.stream.close()
        self.stream = None


# Checked on the received bytes through the exponent masks, with no copy and for bfloat16 too
# (numpy has no bfloat16).
_UINT = {2: np.uint16, 4: np.uint32}


def all_finite(dtype: str, payload) -> bool:
    """Whether every value of a float tensor's raw bytes is finite (other dtypes: True)."""
    if dtype not in EXPONENT_MASKS or not len(payload):
        return True
    width, mask = EXPONENT_MASKS[dtype]
    int_type = _UINT[width]
    bits = np.frombuffer(payload, dtype=int_type)
    return not bool(np.any((bits & int_type(mask)) == int_type(mask)))
