"""Push mode on the peer: accept a step from the previous hop, run it, send it on to the next.

The client opens a session on every hop as in client-driven mode (each peer's KV reservation and
owner checks are unchanged), then tells each hop after the first which peer may push into that
session (``AllowPush``, sent by the session's owner on its own stream). A ``PushForward`` names
a session and the rest of the route; the peer runs its span and sends the hidden states to
``route[0]`` as a client of that peer (one stream per session, opened with the same transport a
client uses: libp2p, or the direct TLS path pinned through it), and relays the reply it gets back
(the last hop's token) to whoever pushed to it. Back along the chain, not straight to the client:
the client needs no reachable address, and only the first hop's reply is ever trusted as an
answer to the client's request.

A peer pushes only to the peer id the route names, over a transport that authenticates that id;
and it accepts a push only from the peer id the session's owner allowed. A downstream failure is
answered with an ``ErrorReply`` whose ``failed_peer`` names the hop that failed (the next hop, or
whatever later hop the next one named), so the client bans, re-routes and replays as ever.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Optional

import msgspec

from p2pserve.errors import WIRE_ERRORS, BadRequestError, ErrorCode, MalformedFrameError
from p2pserve.protocol import (
    SESSION_PROTOCOL,
    AllowPush,
    ErrorReply,
    ForwardResult,
    FrameLimits,
    PushAllowed,
    PushForward,
    PushHop,
    decode_reply,
    error_reply,
)
from p2pserve.transport import Stream, Transport
from p2pserve.transport.frames import read_frame, write_frame

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForwardingConfig:
    """Bounds on a peer's pushes to the next hop: dialling it, and the rest of the chain's answer,
    ``call_timeout_s`` per hop still to run (every later hop's compute and links)."""

    connect_timeout_s: float = 20.0
    call_timeout_s: float = 60.0


def check_route(route: list[PushHop], self_id: str) -> None:
    """Raise BadRequestError unless ``route`` (the hops after this one) is usable: no peer twice,
    not this peer again, no session id twice, and every multiaddr pointing at its hop's peer id
    (a hop's addresses cannot make this peer dial someone else). Its length was bounded by the
    decoder (``MAX_PUSH_HOPS``)."""
    peers = [h.peer_id for h in route]
    if len(set(peers)) != len(peers) or self_id in peers:
        raise BadRequestError("a push route names a peer twice (or this peer again)")
    if len({h.session_id for h in route}) != len(route):
        raise BadRequestError("a push route names a session twice")
    for hop in route:
        if any(not m.endswith(f"/p2p/{hop.peer_id}") for m in hop.maddrs):
            raise BadRequestError(f"a multiaddr of push hop {hop.peer_id} does not end with /p2p/{hop.peer_id}")


class _Link:
    """This peer's stream to the next hop of one session (one step in flight on it at a time)."""

    def __init__(self, peer_id: str, stream: Stream, session):
        self.peer_id, self.stream, self.session, self.lock = peer_id, stream, session, asyncio.Lock()


class Forwarder:
    """The push half of a peer's session handler: grants, and links to next hops.

    ``run_local(forward, payload, owner)`` is the handler's own Forward path (it returns the
    ForwardResult and its payload, or raises a typed error); ``transport`` dials next hops.
    """

    def __init__(self, table, transport: Transport, self_id: str, limits: FrameLimits,
                 config: ForwardingConfig = ForwardingConfig()):
        self.table = table
        self.transport = transport
        self.self_id = self_id
        self.limits = limits
        self.config = config
        self._grants: dict[str, tuple[object, str]] = {}  # session id -> (session, allowed peer id)
        self._links: dict[str, _Link] = {}  # our session id -> stream to its next hop

    def allow(self, msg: AllowPush, stream) -> PushAllowed:
        """Record the owner's grant: ``msg.from_peer`` may push into ``msg.session_id``."""
        session = self.table.get(msg.session_id, stream)  # only the owner may grant
        self._prune()
        self._grants[msg.session_id] = (session, msg.from_peer)
        return PushAllowed(session_id=msg.session_id)

    def session_for(self, session_id: str, stream, remote: str):
        """The session a PushForward on ``stream`` (from ``remote``) may drive: one the stream
        opened (the first hop), or one whose grant names ``remote``; else SessionNotFoundError,
        exactly as for an id never opened."""
        grant = self._grants.get(session_id)
        if grant is not None and grant[1] == remote:
            return self.table.get(session_id, grant[0].owner)  # raises unless still open
        return self.table.get(session_id, stream)

    async def push(self, msg: PushForward, payload: bytes, stream, remote: str, run_local) -> tuple[object, bytes]:
        """Run ``msg`` here and, when a route follows, on the next hops; the reply to relay back."""
        check_route(msg.route, self.self_id)
        session = self.session_for(msg.forward.session_id, stream, remote)
        local = msg.forward if not msg.route else msgspec.structs.replace(msg.forward, outputs=1)
        result, out = await run_local(local, payload, session.owner)
        if not msg.route:
            return result, out
        if result.tensor is None:  # this span ends at the last layer: nothing to forward
            raise BadRequestError("a push route cannot follow the hop holding the last layer")
        nxt = msg.route[0]
        onward = PushForward(forward=msgspec.structs.replace(msg.forward, session_id=nxt.session_id,
                                                             tensor=result.tensor),
                             route=msg.route[1:])
        try:
            return await self._call_next(session, nxt, onward, out)
        except (*WIRE_ERRORS, ConnectionError, TimeoutError, asyncio.IncompleteReadError) as e:
            self._drop_link(msg.forward.session_id)  # out of sync, or gone
            code = getattr(e, "code", ErrorCode.INTERNAL)  # unreachable: the client bans that hop
            log.info("push to %s failed: %r", nxt.peer_id, e)
            return error_reply(code, f"cannot reach next hop {nxt.peer_id}: {type(e).__name__} {e}",
                               msg.forward.session_id, msg.forward.step, nxt.peer_id), b""

    async def _call_next(self, session, nxt: PushHop, onward: PushForward, payload: bytes):
        """Send ``onward`` to ``nxt`` and return its reply to relay: a ForwardResult as received (the
        client checks the last hop's answer), or an ErrorReply naming the hop at fault."""
        link, fresh = await self._link(session, nxt)
        try:
            header, body = await self._exchange(link, onward, payload)
        except (ConnectionError, asyncio.IncompleteReadError):
            if fresh:
                raise
            # A link idle past the next peer's stream timeout was closed by it: that is not the
            # next hop failing. Once more on a new stream (a repeated Forward rewinds, so it is safe).
            self._drop_link(session.id)
            link, _ = await self._link(session, nxt)
            header, body = await self._exchange(link, onward, payload)
        reply = decode_reply(header)
        if isinstance(reply, ErrorReply):
            # A later hop's own blame is relayed only if it names a hop after the next one.
            later = {h.peer_id for h in onward.route}
            blamed = reply.failed_peer if reply.failed_peer in later else nxt.peer_id
            return msgspec.structs.replace(reply, session_id=session.id, failed_peer=blamed), b""
        if not isinstance(reply, ForwardResult):
            raise MalformedFrameError(f"expected ForwardResult, got {type(reply).__name__}")
        return reply, body

    async def _exchange(self, link: _Link, msg: PushForward, payload: bytes) -> tuple[bytes, bytes]:
        """One frame to the next hop and its reply frame, under the call timeout per hop still to
        run: the hop nearest a hang times out first, so it is the one named."""
        async with link.lock, asyncio.timeout(self.config.call_timeout_s * (1 + len(msg.route))):
            await write_frame(link.stream.writer, msg, payload)
            return await read_frame(link.stream.reader, self.limits)

    async def _link(self, session, nxt: PushHop) -> tuple[_Link, bool]:
        """The stream to ``nxt`` for ``session``, opened on first use (authenticated to its id),
        and whether it was opened just now."""
        link = self._links.get(session.id)
        if link is not None and link.peer_id == nxt.peer_id and link.session is session:
            return link, False
        self._drop_link(session.id)
        self._prune()
        try:
            stream = await self.transport.open_stream(nxt.peer_id, list(nxt.maddrs), SESSION_PROTOCOL,
                                                      self.config.connect_timeout_s)
        except (ConnectionError, TimeoutError):
            raise
        except Exception as e:  # whatever dialling raised (the libp2p daemon's ControlFailure): unreachable
            raise ConnectionError(f"{type(e).__name__}: {e}") from e
        link = self._links[session.id] = _Link(nxt.peer_id, stream, session)
        return link, True

    def _drop_link(self, session_id: str) -> None:
        link: Optional[_Link] = self._links.pop(session_id, None)
        if link is not None:
            link.stream.close()

    def _prune(self) -> None:
        """Forget grants and links of sessions that are no longer open (closed, expired, moved)."""
        for sid in [s for s, (session, _) in self._grants.items() if not self._open(session)]:
            del self._grants[sid]
        for sid in [s for s, link in self._links.items() if not self._open(link.session)]:
            self._drop_link(sid)

    def _open(self, session) -> bool:
        """Whether ``session`` is still the open session under its id."""
        try:
            return session is not None and self.table.get(session.id, session.owner) is session
        except WIRE_ERRORS:
            return False
