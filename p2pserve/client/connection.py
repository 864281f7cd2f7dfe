"""One client-side stream to one peer, carrying one session hop.

Every call sends a frame and waits for its reply under a timeout; a typed ``ErrorReply`` is
raised as the matching class of ``errors.ERROR_CLASSES``, naming the peer.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import torch

from p2pserve.errors import WIRE_ERRORS, MalformedFrameError, P2PServeError, error_from_reply
from p2pserve.protocol import (
    PROTOCOL_VERSION,
    SESSION_PROTOCOL,
    AttachDirect,
    CloseSession,
    DirectAttached,
    DirectOffer,
    ErrorReply,
    Forward,
    ForwardResult,
    FrameLimits,
    GetStats,
    PeerStats,
    OpenDirect,
    OpenSession,
    SamplingParams,
    SessionOpened,
    TensorMeta,
    decode_reply,
)
from p2pserve.transport import maddr_hosts, read_frame, set_nodelay, tensor_from_wire, tensor_to_wire, write_frame

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hop:
    """Run layers [start, end) on ``peer_id`` (reachable at ``maddrs``)."""

    peer_id: str
    start: int
    end: int
    maddrs: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.peer_id[-8:]}[{self.start}:{self.end})"


async def connect_p2p(p2p, hops: list[Hop]) -> None:
    """Make sure the libp2p daemon can reach every hop (dial the maddrs we were given)."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    for hop in hops:
        if hop.maddrs:
            # The daemon wants transport addresses; the /p2p/<id> suffix goes in peer_id.
            addrs = [Multiaddr(m.split("/p2p/")[0]) for m in hop.maddrs]
            await p2p._client.connect(PeerID.from_base58(hop.peer_id), addrs)


class HopConnection:
    """A session stream to one peer: the direct TCP path when it works, else the libp2p stream."""

    def __init__(self, p2p, hop: Hop, limits: FrameLimits, timeout_s: float, direct: bool = True,
                 direct_timeout_s: float = 2.0):
        self.p2p = p2p
        self.hop = hop
        self.limits = limits
        self.timeout_s = timeout_s
        self.direct = direct
        self.direct_timeout_s = direct_timeout_s
        self.transport = "none"  # "direct" or "libp2p" once connected
        self._reader = self._writer = None
        self.session_id: str | None = None
        self.opened: SessionOpened | None = None

    async def open(self, model_id: str, session_id: str, max_length: int, sampling: SamplingParams) -> SessionOpened:
        """Open the stream and the session on the peer."""
        await self.connect()
        msg = OpenSession(
            version=PROTOCOL_VERSION,
            model_id=model_id,
            session_id=session_id,
            start=self.hop.start,
            end=self.hop.end,
            max_length=max_length,
            sampling=sampling,
        )
        reply, _ = await self._call(msg)
        if not isinstance(reply, SessionOpened):
            raise MalformedFrameError(f"expected SessionOpened from {self.hop}, got {type(reply).__name__}")
        self.session_id, self.opened = session_id, reply
        return reply

    async def forward(self, step: int, position: int, inputs: torch.Tensor) -> ForwardResult | tuple:
        """Send inputs for [position, position + n); returns (result, hidden or None)."""
        meta, data = tensor_to_wire(inputs)
        reply, payload = await self.forward_wire(step, position, meta, data)
        hidden = tensor_from_wire(reply.tensor, payload) if reply.tensor is not None else None
        return reply, hidden

    async def forward_wire(self, step: int, position: int, meta: TensorMeta, data) -> tuple[ForwardResult, bytes]:
        """:meth:`forward` on inputs already in wire form; returns (result, raw hidden bytes).

        A chain passes one hop's hidden states to the next as the bytes it received, never
        decoding them into a tensor: a prefill's activations are copied once less per hop. They
        are checked here against the shape and dtype this hop must return ([n, hidden] in the
        model's dtype), so a malformed answer is blamed on the hop that sent it (retriable),
        not on the next hop that would refuse it.
        """
        msg = Forward(session_id=self.session_id, step=step, position=position, tensor=meta)
        reply, payload = await self._call(msg, data)
        if not isinstance(reply, ForwardResult):
            raise MalformedFrameError(f"expected ForwardResult from {self.hop}, got {type(reply).__name__}")
        if reply.tensor is not None:
            reply.tensor.validate(len(payload))
            want = [meta.shape[0], self.opened.hidden_size] if self.opened else None
            if want is not None and (list(reply.tensor.shape) != want or reply.tensor.dtype != self.opened.dtype):
                raise MalformedFrameError(
                    f"{self.hop} returned hidden states {reply.tensor.dtype} {list(reply.tensor.shape)}, "
                    f"expected {self.opened.dtype} {want}"
                )
        return reply, payload

    async def connect(self) -> None:
        """Open the stream (dialling the hop's addresses first) without opening a session."""
        from hivemind.p2p import PeerID

        await connect_p2p(self.p2p, [self.hop])
        _, self._reader, self._writer = await asyncio.wait_for(
            self.p2p.call_binary_stream_handler(PeerID.from_base58(self.hop.peer_id), SESSION_PROTOCOL),
            self.timeout_s,
        )
        self.transport = "libp2p"
        if self.direct:
            await self._try_direct()

    async def _try_direct(self) -> None:
        """Move to the peer's direct TCP path if it offers one and it answers; else stay on libp2p.

        The offer comes over the libp2p stream (which authenticated the peer), and the peer must
        echo its id on the new connection (see ``p2pserve/peer/direct.py``).
        """
        try:
            offer, _ = await self._call(OpenDirect())
        except WIRE_ERRORS as e:  # a peer without the direct path
            log.debug("no direct path to %s: %s", self.hop, e)
            return
        if not isinstance(offer, DirectOffer) or not offer.port:
            return
        for host in maddr_hosts(self.hop.maddrs):
            writer = None
            try:
                async with asyncio.timeout(self.direct_timeout_s):
                    reader, writer = await asyncio.open_connection(host, offer.port)
                    set_nodelay(writer)
                    await write_frame(writer, AttachDirect(token=offer.token))
                    header, _ = await read_frame(reader, self.limits)
                ack = decode_reply(header)
                if not isinstance(ack, DirectAttached) or ack.peer_id != self.hop.peer_id:
                    raise ConnectionError(f"{host}:{offer.port} is not {self.hop.peer_id}")
            except (OSError, TimeoutError, asyncio.IncompleteReadError, P2PServeError) as e:
                log.debug("direct path to %s via %s failed: %s", self.hop, host, e)
                if writer is not None:
                    writer.close()
                continue
            self._writer.close()  # the libp2p stream carried no session yet
            self._reader, self._writer = reader, writer
            self.transport = "direct"
            return

    async def stats(self) -> PeerStats:
        """Ask the peer for its load counters."""
        if self._writer is None:
            await self.connect()
        reply, _ = await self._call(GetStats())
        return reply

    async def close(self) -> None:
        """Close the session (best effort) and the stream."""
        if self._writer is None:
            return
        try:
            if self.session_id is not None:
                await asyncio.wait_for(self._call(CloseSession(session_id=self.session_id)), 2.0)
        except Exception:  # the peer may be dead; closing is best effort
            pass
        try:
            self._writer.close()
        except Exception:
            pass
        self._writer = self._reader = None

    async def _call(self, msg, payload=b""):
        if self._writer is None:
            raise ConnectionError(f"stream to {self.hop} is closed")

        try:
            async with asyncio.timeout(self.timeout_s):  # no extra task per call, unlike wait_for
                await write_frame(self._writer, msg, payload)
                header, body = await read_frame(self._reader, self.limits)
            reply = decode_reply(header)
        except asyncio.IncompleteReadError:
            raise ConnectionError(f"peer {self.hop} closed the stream") from None
        if isinstance(reply, ErrorReply):
            raise error_from_reply(reply.code, reply.message, peer=self.hop.peer_id)
        return reply, body
