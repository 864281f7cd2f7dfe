"""Push mode on the client: one step sent to the first hop, forwarded peer to peer, the token
straight back from the last hop.

The route's sessions are opened exactly as in client-driven mode (``Pipeline._open_route``).
Before the first pushed step the client tells every hop after the first which peer may push into
its session (``AllowPush``, on the client's own stream: only a session's owner can grant it).
Then a step is two frames sent at once: a ``PushForward`` to the first hop naming the rest of the
route (peer ids and session ids; each peer dials the next where that peer announced itself,
``p2pserve/peer/next_hop.py``), and an ``AwaitResult`` to the last hop on the client's stream to
it. Each peer runs its span and sends its hidden states on (``p2pserve/peer/forwarding.py``); the
last hop answers the AwaitResult with its ForwardResult, which the client checks as it checks a
last hop's reply. With one-way delay ``d`` on every link a step of ``h`` hops costs ``(h + 1) d``
of network time instead of client-driven's ``2 h d``.

The first hop answers the PushForward with a ``PushAck`` once the whole chain has run the step
(it reaches the client after the token did, and is read while the next step is under way), or
with an ``ErrorReply`` whose ``failed_peer`` names the hop at fault. Either failure, or a lost
stream or timeout, becomes a ``HopFailure`` of that hop, and the pipeline bans, re-routes and
replays exactly as in client-driven mode. A hop's blame of a later one is only as honest as that
hop (the cost of not driving each hop from the client).
"""

from __future__ import annotations

import asyncio
from typing import Optional, Sequence

from p2pserve.blame import blamed_hop
from p2pserve.client.connection import HopConnection
from p2pserve.client.failover import HopFailure
from p2pserve.errors import BadRequestError, MalformedFrameError, error_from_reply
from p2pserve.protocol import (
    AllowPush,
    AwaitResult,
    ErrorReply,
    Forward,
    PushAck,
    PushAllowed,
    PushForward,
    PushHop,
)

class PushRefused(Exception):
    """A hop refused a grant as a request it does not take (a peer with no push support): the
    route's steps are driven by the client instead. Not a failure of the hop."""

    def __init__(self, hop, cause: BaseException):
        super().__init__(f"{hop} takes no push-mode steps: {cause}")
        self.hop = hop


async def grant(links: Sequence[HopConnection]) -> None:
    """Allow each hop's predecessor to push into its session (in parallel); HopFailure names the
    first hop, in route order, that refused."""
    await grant_all(links, [AllowPush(session_id=n.session_id, from_peer=p.hop.peer_id) for p, n in zip(links, links[1:])])


async def grant_all(links: Sequence[HopConnection], grants: Sequence[AllowPush]) -> None:
    """Send each grant to the hop whose session it names (in parallel); HopFailure names the
    first hop, in route order, that refused."""
    async def allow(link: HopConnection, msg: AllowPush) -> None:
        try:
            reply, _ = await link.call(msg)
            if not isinstance(reply, PushAllowed) or reply.session_id != link.session_id:
                raise MalformedFrameError(f"expected PushAllowed from {link.hop}, got {type(reply).__name__}")
        except BadRequestError as e:
            raise PushRefused(link.hop, e) from e
        except Exception as e:  # whatever broke is this hop's failure
            raise HopFailure(link.hop, e) from e

    by_session = {g.session_id: g for g in grants}
    results = await asyncio.gather(*(allow(c, by_session[c.session_id]) for c in links if c.session_id in by_session),
                                   return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


def peer_of(link: HopConnection) -> str:
    """The peer id of a route's connection (what a relayed blame names)."""
    return link.hop.peer_id


class PushedRoute:
    """One route's pushed steps: the grants (once), and the first hop's ack still to be read."""

    def __init__(self, links: Sequence[HopConnection]):
        self.links = list(links)
        self.granted = False
        self._ack: Optional[asyncio.Task] = None  # reads the first hop's replies, in order

    async def step(self, forward: Forward, payload: bytes, n: int, vocab_size: Optional[int]):
        """Push ``forward`` (for the first hop's session, ``n`` positions, ``outputs`` for the last
        hop) through the route; returns the last hop's checked ForwardResult."""
        first, last = self.links[0], self.links[-1]
        if not self.granted:
            await grant(self.links)
            self.granted = True
        route = [PushHop(peer_id=c.hop.peer_id, session_id=c.session_id) for c in self.links[1:]]
        wait = AwaitResult(session_id=last.session_id, step=forward.step)
        for link, msg, data in ((last, wait, b""), (first, PushForward(forward=forward, route=route), payload)):
            await write_to(link, msg, data)
        self._ack = ack = asyncio.create_task(self._read_ack(self._ack, forward.step))
        result = asyncio.create_task(read_reply(last))
        try:
            async with asyncio.timeout(first.timeout_s * len(self.links)):  # a hop timeout per hop, as client-driven
                await asyncio.wait([ack, result], return_when=asyncio.FIRST_COMPLETED)
                if ack.done() and not result.done():
                    ack.result()  # a failure named by the chain, else the chain acked before the token came
                    await asyncio.wait([result])
        except TimeoutError as e:
            raise HopFailure((last if ack.done() else first).hop, e) from e
        finally:
            result.cancel()  # still reading only when the step failed: the route is dropped
        reply, body = self._checked_wait(result)
        if isinstance(reply, ErrorReply):
            if ack.done():
                ack.result()  # the first hop's account names the hop at fault, when it came first
            raise HopFailure(last.hop, error_from_reply(reply.code, reply.message, peer=last.hop.peer_id))
        try:
            last.check_forward(reply, body, n, forward.step, forward.position, True, vocab_size, forward.outputs)
        except Exception as e:  # a bad answer, from the last hop itself
            raise HopFailure(last.hop, e) from e
        return reply

    def _checked_wait(self, task: asyncio.Task):
        """The last hop's answer to AwaitResult, or HopFailure of the last hop."""
        try:
            return task.result()
        except asyncio.IncompleteReadError as e:
            raise HopFailure(self.links[-1].hop, ConnectionError(f"peer {self.links[-1].hop} closed the stream")) from e
        except Exception as e:
            raise HopFailure(self.links[-1].hop, e) from e

    async def _read_ack(self, previous: Optional[asyncio.Task], step: int) -> None:
        """The first hop's reply to step ``step`` (after the previous step's, on the same stream):
        return on its PushAck, else HopFailure of the hop the chain named."""
        if previous is not None:
            await previous
        first = self.links[0]
        try:
            reply, _ = await read_reply(first)
        except asyncio.IncompleteReadError as e:
            raise HopFailure(first.hop, ConnectionError(f"peer {first.hop} closed the stream")) from e
        except Exception as e:
            raise HopFailure(first.hop, e) from e
        if isinstance(reply, ErrorReply):
            at = blamed_hop(reply.failed_peer, self.links[1:], first, peer_of=peer_of)  # unknown: the first hop's
            raise HopFailure(at.hop, error_from_reply(reply.code, reply.message, peer=at.hop.peer_id))
        if not isinstance(reply, PushAck) or reply.step != step:
            raise HopFailure(first.hop, MalformedFrameError(f"expected the PushAck of step {step}, got {reply!r:.80}"))

    async def settle(self, timeout_s: float = 2.0) -> None:
        """Read the first hop's last ack before its stream carries anything else (best effort:
        on any failure the route is being dropped anyway)."""
        ack, self._ack = self._ack, None
        if ack is None:
            return
        try:
            async with asyncio.timeout(timeout_s):
                await ack
        except Exception:  # dropped either way
            ack.cancel()


async def read_reply(link: HopConnection):
    """One reply frame from ``link``'s stream, decoded: (reply, payload)."""
    return await link.read()


async def write_to(link: HopConnection, msg, payload=b"") -> None:
    """One frame to ``link``'s stream; HopFailure of that hop if it cannot be written."""
    try:
        async with asyncio.timeout(link.timeout_s):
            await link.send(msg, payload)
    except Exception as e:
        raise HopFailure(link.hop, e) from e
