"""Push mode on the client: one step sent to the first hop, forwarded peer to peer.

The route's sessions are opened exactly as in client-driven mode (``Pipeline._open_route``).
Before the first pushed step the client tells every hop after the first which peer may push into
its session (``AllowPush``, on the client's own stream: only a session's owner can grant it).
Then a step is one ``PushForward`` to the first hop naming the rest of the route; each peer runs
its span and sends its hidden states on (``p2pserve/peer/forwarding.py``), and the last hop's
ForwardResult comes back along the chain. The client checks it as it checks a last hop's reply.

A failure anywhere comes back as an ``ErrorReply`` whose ``failed_peer`` names the hop at fault
(or as a lost stream / timeout of the first hop): it becomes a ``HopFailure`` of that hop, and
the pipeline bans, re-routes and replays exactly as in client-driven mode. A hop's blame of a
later one is only as honest as that hop (the cost of not driving each hop from the client).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Optional, Sequence

from p2pserve.client.connection import HopConnection
from p2pserve.client.failover import HopFailure
from p2pserve.errors import MalformedFrameError, error_from_reply
from p2pserve.protocol import (
    MAX_PUSH_HOPS,
    AllowPush,
    ErrorReply,
    Forward,
    PushAllowed,
    PushForward,
    PushHop,
    decode_reply,
)
from p2pserve.transport.frames import read_frame, write_frame


@dataclass(frozen=True)
class PushConfig:
    """When a pipeline pushes its steps peer to peer instead of driving every hop.

    ``enabled`` False (the default) keeps client-driven hops everywhere: push is not measured to
    win on every link (docs/wan.md, "Push mode"). With it on, a route is pushed when it has at
    least ``min_hops`` hops and the median round trip the client measured opening its sessions
    (no compute behind it: the link) is at least ``min_rtt_ms``, unless outputs are verified (the
    verifier re-executes each hop's recorded exchange, which push does not show the client).
    """

    enabled: bool = False
    min_hops: int = 2
    min_rtt_ms: float = 40.0  # measured: 0.80x at 50 ms RTT, 1.31x at 10 ms (docs/wan.md)

    def use_push(self, hops: int, verified: bool, rtts_s: Sequence[float | None] = ()) -> bool:
        """Whether a route of ``hops`` hops, whose sessions opened in ``rtts_s`` seconds (None:
        not measured, counted as 0), is pushed."""
        if not self.enabled or verified or not self.min_hops <= hops <= MAX_PUSH_HOPS + 1:
            return False
        if self.min_rtt_ms <= 0:
            return True
        rtts = sorted(r or 0.0 for r in rtts_s)
        return bool(rtts) and 1e3 * rtts[len(rtts) // 2] >= self.min_rtt_ms


async def grant(links: Sequence[HopConnection]) -> None:
    """Allow each hop's predecessor to push into its session (in parallel); HopFailure names the
    first hop, in route order, that refused."""
    async def allow(prev: HopConnection, link: HopConnection) -> None:
        try:
            reply, _ = await link.call(AllowPush(session_id=link.session_id, from_peer=prev.hop.peer_id))
            if not isinstance(reply, PushAllowed) or reply.session_id != link.session_id:
                raise MalformedFrameError(f"expected PushAllowed from {link.hop}, got {type(reply).__name__}")
        except Exception as e:  # whatever broke is this hop's failure
            raise HopFailure(link.hop, e) from e

    results = await asyncio.gather(*(allow(p, n) for p, n in zip(links, links[1:])), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


async def push_step(links: Sequence[HopConnection], forward: Forward, payload: bytes, n: int,
                    vocab_size: Optional[int]) -> object:
    """Push ``forward`` (for the first hop's session, ``n`` positions, ``outputs`` for the last
    hop) through the route; returns the last hop's checked ForwardResult."""
    first, last = links[0], links[-1]
    route = [PushHop(peer_id=c.hop.peer_id, session_id=c.session_id,
                     maddrs=[m for m in c.hop.maddrs if m.endswith(f"/p2p/{c.hop.peer_id}")][:4])
             for c in links[1:]]
    try:
        if first.stream is None:
            raise ConnectionError(f"stream to {first.hop} is closed")
        async with asyncio.timeout(first.timeout_s * len(links)):  # a hop timeout per hop, as client-driven
            await write_frame(first.stream.writer, PushForward(forward=forward, route=route), payload)
            header, body = await read_frame(first.stream.reader, first.limits)
        reply = decode_reply(header)
    except asyncio.IncompleteReadError as e:
        raise HopFailure(first.hop, ConnectionError(f"peer {first.hop} closed the stream")) from e
    except Exception as e:
        raise HopFailure(first.hop, e) from e
    if isinstance(reply, ErrorReply):
        at = {c.hop.peer_id: c for c in links[1:]}.get(reply.failed_peer, first)  # unknown names: the first hop's
        raise HopFailure(at.hop, error_from_reply(reply.code, reply.message, peer=at.hop.peer_id))
    try:
        last.check_forward(reply, body, n, forward.step, forward.position, True, vocab_size, forward.outputs)
    except Exception as e:  # a bad answer: whoever relayed it could have made it up; blame the first hop
        raise HopFailure(first.hop, e) from e
    return reply
