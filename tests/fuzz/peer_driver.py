"""What the stateful test needs to drive one real peer process: an event loop in a thread (so the
synchronous rules of a Hypothesis state machine can await the network), raw connections that
return every reply (ErrorReply included) instead of raising, and the single-process reference.

Nothing here is faked: the peer is a ``p2pserve peer`` process, the connections are the client's
transports (the direct TCP path and libp2p), and the reference is transformers on the same
weights in fp32.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import torch

from p2pserve.config import ClientConfig
from p2pserve.protocol import FRAME_PREFIX, SESSION_PROTOCOL, GetStats, PeerStats, decode_reply, encode_frame
from p2pserve.transport.frames import read_frame, tensor_from_wire

#: Seconds a reply may take before the peer counts as stuck (a busy 2-core machine, a prefill).
REPLY_TIMEOUT_S = 30.0
LIMITS = ClientConfig().frame_limits


class LoopThread:
    """An asyncio loop running in a daemon thread; :meth:`call` runs a coroutine on it and waits."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fuzz-client-loop", daemon=True)
        self._thread.start()

    def call(self, coro, timeout_s: float = 2 * REPLY_TIMEOUT_S):
        """The coroutine's result; AssertionError if it takes longer than ``timeout_s`` (stuck)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise AssertionError(f"no answer from the peer within {timeout_s} s: it is stuck") from None

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


class Conn:
    """One stream to the peer (one owner): sends frames, returns the decoded reply and its payload."""

    def __init__(self, stream):
        self.stream = stream

    @classmethod
    async def open(cls, transport, peer, direct: bool = True) -> "Conn":
        """A session stream over the direct path (``transport`` upgrades it) or plain libp2p."""
        via = transport if direct else transport.inner
        return cls(await via.open_stream(peer.peer_id, list(peer.maddrs), SESSION_PROTOCOL, REPLY_TIMEOUT_S))

    async def send(self, msg, payload=b"") -> None:
        """Write one well-formed frame."""
        self.stream.writer.write(b"".join(bytes(part) for part in encode_frame(msg, payload)))
        await self.stream.writer.drain()

    async def send_raw(self, data: bytes) -> None:
        """Write bytes as they are (a frame the encoder would not make)."""
        self.stream.writer.write(data)
        await self.stream.writer.drain()

    async def reply(self, timeout_s: float = REPLY_TIMEOUT_S):
        """The next reply, decoded; every reply the peer sends must decode (a typed one)."""
        async with asyncio.timeout(timeout_s):
            header, payload = await read_frame(self.stream.reader, LIMITS)
        return decode_reply(header), payload

    async def call(self, msg, payload=b""):
        await self.send(msg, payload)
        return await self.reply()

    async def call_raw(self, data: bytes):
        await self.send_raw(data)
        return await self.reply()

    async def stats(self) -> PeerStats:
        reply, _ = await self.call(GetStats())
        assert isinstance(reply, PeerStats), reply
        return reply

    def close(self) -> None:
        self.stream.close()


def raw_frame(header: bytes, payload: bytes = b"") -> bytes:
    """A frame whose prefix tells the truth about ``header`` and ``payload``."""
    return FRAME_PREFIX.pack(len(header), len(payload)) + header + payload


def hidden_of(reply, payload: bytes) -> torch.Tensor:
    """The hidden states a ForwardResult carries."""
    return tensor_from_wire(reply.tensor, payload)


@dataclass
class Reference:
    """The single-process oracle over one token script: greedy next tokens and hidden states.

    ``script`` is a prompt and its greedy continuation (``tests.harness.reference_generate``).
    ``top2[i]`` are the two likeliest next tokens after ``script[:i + 1]`` and ``margin[i]`` their
    logit gap; ``hidden[l][i]`` is the residual stream after ``l`` layers at position ``i``.
    """

    script: list[int]
    top2: list[tuple[int, int]]
    margin: list[float]
    hidden: list[torch.Tensor]

    @classmethod
    def build(cls, path: str, prompt: list[int], new_tokens: int) -> "Reference":
        from tests.harness import _reference_model, reference_generate

        script = prompt + reference_generate(path, prompt, new_tokens)
        with torch.no_grad():
            out = _reference_model(path)(torch.tensor([script]), output_hidden_states=True)
        logits = out.logits[0].float()
        values, ids = torch.topk(logits, 2, dim=-1)
        ref = cls(script, [tuple(map(int, row)) for row in ids], (values[:, 0] - values[:, 1]).tolist(),
                  [h[0].float() for h in out.hidden_states])
        # the oracle agrees with itself: greedy generation took the argmax after every prefix
        for i in range(len(prompt) - 1, len(script) - 1):
            assert ref.top2[i][0] == script[i + 1] or ref.margin[i] < 1e-3
        return ref

    def token_ok(self, token: int, last: int) -> bool:
        """Whether ``token`` is the greedy choice after ``script[:last + 1]`` (either of a near tie)."""
        best, second = self.top2[last]
        return token == best or (self.margin[last] < 1e-3 and token == second)
