"""Ring mode on the client: the last hop feeds each sampled token straight back to the first hop.

Push mode (``client/push.py``) costs a decode token ``h + 1`` link crossings: client -> p1 -> ...
-> ph -> client. In a ring the client pushes only the ring's first step (the prompt, or whatever
the route does not hold yet); from then on the last hop, once it sampled step ``s``'s token,
answers the client's ``AwaitResult`` and pushes step ``s + 1`` (that token as input) to the first
hop itself (``peer/ring.py``). A decode token then crosses ``h`` links, and the client only
listens: the network floor against client-driven's ``2 h`` is 0.5 whatever ``h``.

The client bounds the ring when it starts it: every hop gets a ``RingGrant`` from its owner
(the first step, the last position the ring may reach, the stop tokens), and checks each step
against it. It also keeps the ring at most a step ahead of what it asked for (each
``AwaitResult`` carries ``ring_until``), so when it stops for a reason the peers cannot see (a
stop string, or a step that is not the ring's next token: a rewind, a new turn), the ring halts
within a step; ``drain`` reads what is still coming before the route carries anything else.
Positions the ring computed past the stop are rewound by the next step's position, as a
speculative step's rejected ones are. Greedy output stays identical to ``generate``: the last
hop samples exactly as for a pushed or client-driven step (seeded per absolute position).

Every hop before the last sends the client its signed reply of each ring step unasked
(``RingGrant.report``), in the same write as the step's batch to the next peer; the client reads
them once the last hop's token of that step is in, before the token goes on, so each token comes
with every hop's signed claim, and the hops see the same messages whether the client verifies.

Failures: every hop reports a ring step it cannot send on, or a next hop's error, timeout or
lost stream, up the ring to the last hop, which answers the client's wait with an ErrorReply
whose ``failed_peer`` names the hop at fault, and the pipeline bans, re-routes and replays as in
every mode. The client's own timeout covers a silent ring (``SilentRingError``): any hop may be
the silent one, so the pipeline blames nobody and drives the route, whose calls name it.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Optional, Sequence

from p2pserve.blame import blamed_hop
from p2pserve.client.connection import HopConnection
from p2pserve.client.failover import HopFailure
from p2pserve.client.push import grant_all, peer_of, read_reply, write_to
from p2pserve.errors import MalformedFrameError, SilentRingError, error_from_reply
from p2pserve.protocol import (
    MAX_RING_AHEAD,
    AllowPush,
    AwaitResult,
    ErrorReply,
    Forward,
    ForwardResult,
    PushAck,
    PushForward,
    PushHop,
    RingGrant,
    RingStopped,
)


def ring_grants(links: Sequence[HopConnection], start: Forward, n: int, max_position: int,
                stop_tokens: Sequence[int], context: Optional[Sequence[int]] = None) -> list[AllowPush]:
    """One grant per hop for a ring starting with ``start`` (``n`` positions): the first hop
    takes ring steps from the last (and routes them on), each other from the hop before it,
    and the last pushes to the first. ``context`` (the start's token ids) goes to the last hop
    when the session's penalties need its history."""
    hops = [PushHop(peer_id=c.hop.peer_id, session_id=c.session_id) for c in links]
    base = dict(start_step=start.step, start_position=start.position, start_tokens=n, max_position=max_position,
                stop_tokens=sorted(set(stop_tokens)))
    grants = []
    for i, hop in enumerate(hops):
        last = i == len(hops) - 1
        ring = RingGrant(**base, route=hops[1:] if i == 0 else [], successor=hops[0] if last else None,
                         context=list(context) if last and context is not None else None, report=not last)
        grants.append(AllowPush(session_id=hop.session_id, from_peer=hops[i - 1].peer_id, ring=ring))
    return grants


class RingRoute:
    """One route's ring: started by ``start``, continued by ``next`` while the caller's step is
    the ring's next token, and ``drain``ed before the route carries anything else."""

    def __init__(self, links: Sequence[HopConnection], window: int = 1):
        self.links = list(links)
        self.window = window  # how many steps the ring may run past the one asked for
        self.active = False
        self._asked: collections.deque[int] = collections.deque()  # steps asked of the last hop, in order
        self._credit = -1  # the highest ring_until sent
        self._last_asked = -1  # the latest step asked for
        self._next: tuple[int, int, int] = (-1, -1, -1)  # (step, position, token) a continuation sends
        self._max_position = 0
        self._start_ack: Optional[asyncio.Task] = None  # the first hop's reply to the ring's start
        # the latest step's (reply, payload) of every hop, in route order: what each hop returned
        # (and, for the one after it, consumed), read from each hop as in a driven step
        self.hop_replies: list[tuple[ForwardResult, bytes]] = []
        # every hop before the last sends each ring step's reply unasked (``RingGrant.report``):
        # those read ahead of their step, per hop, by step; and the latest step read from all
        self._reports: list[dict[int, tuple[ForwardResult, bytes]]] = [{} for _ in self.links[:-1]]
        self._consumed = -1

    def continues(self, sent: Sequence[int], position: int, step: int) -> bool:
        """Whether step ``step`` of ``sent`` at ``position`` is the ring's next step."""
        return self.active and len(sent) == 1 and (step, position, sent[0]) == self._next

    async def start(self, forward: Forward, payload, n: int, vocab_size: Optional[int], max_position: int,
                    stop_tokens: Sequence[int], context: Optional[Sequence[int]] = None) -> ForwardResult:
        """Grant the ring to every hop, push its first step, and return its result
        (``context``: see :func:`ring_grants`)."""
        await self.drain()
        first, last = self.links[0], self.links[-1]
        self._max_position = max(max_position, forward.position + n - 1)
        await grant_all(self.links, ring_grants(self.links, forward, n, self._max_position, stop_tokens, context))
        self._asked.clear()
        self._credit = self._last_asked = -1  # step numbers are the pipeline's: a new ring may reuse old ones
        self._reports, self._consumed = [{} for _ in self.links[:-1]], -1
        self.active = True
        msg = PushForward(forward=forward, route=[PushHop(peer_id=c.hop.peer_id, session_id=c.session_id)
                                                  for c in self.links[1:]], ring=True)
        if first is last:  # one hop, one stream: its answers come in the order they were asked
            await write_to(first, msg, payload)
            await self._ask(forward.step, forward.position + n)
            await self._read_start_ack(forward.step)
        else:
            await self._ask(forward.step, forward.position + n)
            await write_to(first, msg, payload)
            self._start_ack = asyncio.create_task(self._read_start_ack(forward.step))
        return await self._result(forward.step, forward.position, n, vocab_size)

    async def next(self, vocab_size: Optional[int]) -> ForwardResult:
        """The ring's next step's result (the caller sent the token the ring already has)."""
        step, position, _ = self._next
        return await self._result(step, position, 1, vocab_size)

    async def _ask(self, step: int, next_position: int) -> None:
        """Ask the last hop for ``step``'s result, and (when the position allows) for the one
        after it, and let the ring run ``window`` steps past each (within ``max_position``)."""
        for s, position in ((step, next_position - 1), (step + 1, next_position)):
            if s > self._last_asked and position <= self._max_position:
                self._credit = max(self._credit, s + min(self.window, self._max_position - position))
                self._asked.append(s)
                self._last_asked = s
                await write_to(self.links[-1], AwaitResult(session_id=self.links[-1].session_id, step=s,
                                                         ring_until=self._credit))

    async def _result(self, step: int, position: int, n: int, vocab_size: Optional[int]) -> ForwardResult:
        """Read the last hop's answers up to ``step``'s, check it, and ask ahead for the next."""
        last = self.links[-1]
        reply, body = await self._unless_start_failed(self._read_until(step))
        if isinstance(reply, RingStopped):
            raise HopFailure(last.hop, MalformedFrameError(f"{last.hop} stopped the ring before step {step}"))
        try:
            last.check_forward(reply, body, n, step, position, True, vocab_size, 1)
        except Exception as e:  # a bad answer, from the last hop itself
            raise HopFailure(last.hop, e) from e
        self.hop_replies = [*await self._earlier_hops(step, position, n), (reply, body)]
        self._consumed = step
        self._next = (step + 1, position + n, int(reply.token))
        await self._ask(step + 1, position + n + 1)
        return reply

    async def _earlier_hops(self, step: int, position: int, n: int) -> list[tuple[ForwardResult, bytes]]:
        """Every hop before the last one's signed reply of ``step``, which has run through the
        whole ring (so each sent it, unasked), read in route order. Any answer but that hop's
        checked reply is that hop's failure."""
        earlier = self.links[:-1]
        await self._started()
        out = []
        for i, link in enumerate(earlier):
            try:
                reply, body = await self._report(i, step)
                link.check_forward(reply, body, n, step, position, False, None, 1)
            except Exception as e:
                raise HopFailure(link.hop, e) from e
            out.append((reply, body))
        return out

    async def _started(self) -> None:
        """Wait for the first hop's answer to the ring's start: its stream carries it first."""
        if len(self.links) > 1 and self._start_ack is not None:
            async with asyncio.timeout(self.links[0].timeout_s * len(self.links)):
                await self._start_ack
        self._start_ack = None  # answered: later steps need not wait for it, nor race it

    async def _report(self, hop: int, step: int) -> tuple[ForwardResult, bytes]:
        """Earlier hop ``hop``'s reply of ring step ``step``: read ahead already, or read now
        (replies of earlier steps, which the pipeline did not wait for, are passed over)."""
        link, ahead = self.links[hop], self._reports[hop]
        while step not in ahead:
            for old in [s for s in ahead if s < step]:
                del ahead[old]
            try:
                async with asyncio.timeout(link.timeout_s):
                    reply, body = await read_reply(link)
            except TimeoutError:  # it, or the last hop that said the step ran, is at fault: blame nobody
                raise SilentRingError(f"no reply of ring step {step} from {link.hop} in time") from None
            self._keep(hop, reply, body)
        return ahead.pop(step)

    def _keep(self, hop: int, reply, body: bytes) -> None:
        """Keep a reply earlier hop ``hop`` sent unasked until its step is read; its ErrorReply,
        anything else, or more than the ring can run ahead, is that hop's error."""
        link, ahead = self.links[hop], self._reports[hop]
        if isinstance(reply, ErrorReply):
            raise error_from_reply(reply.code, reply.message, peer=link.hop.peer_id)
        if not isinstance(reply, ForwardResult) or len(ahead) > MAX_RING_AHEAD:
            raise MalformedFrameError(f"{link.hop} sent {reply!r:.80} where a ring step's reply was due")
        ahead[reply.step] = (reply, body)

    async def _unless_start_failed(self, read):
        """Await ``read``, unless the first hop reports first that the ring's start failed (a
        ring that never started would otherwise be waited for until the timeout)."""
        ack = self._start_ack
        if ack is None or (ack.done() and ack.exception() is None):
            return await read
        task = asyncio.ensure_future(read)
        try:
            await asyncio.wait([task, ack], return_when=asyncio.FIRST_COMPLETED)
            if ack.done() and ack.exception() is not None:
                ack.result()
            return await task
        finally:
            task.cancel()

    async def _read_until(self, step: int):
        """The last hop's answer to the AwaitResult of ``step`` (earlier ones, from before a
        restart, are skipped); an ErrorReply becomes a HopFailure of the hop it names."""
        last = self.links[-1]
        while self._asked:
            asked = self._asked.popleft()
            try:
                async with asyncio.timeout(last.timeout_s * len(self.links)):  # a silent ring
                    reply, body = await read_reply(last)
            except TimeoutError:  # any hop may be the silent one: the route is driven to find it
                raise HopFailure(last.hop, SilentRingError(f"no answer from the ring of {len(self.links)} hops "
                                                           f"ending at {last.hop} in time")) from None
            except Exception as e:
                raise HopFailure(last.hop, e) from e
            if isinstance(reply, ErrorReply):
                self.active = False
                at = blamed_hop(reply.failed_peer, self.links, last, peer_of=peer_of)
                raise HopFailure(at.hop, error_from_reply(reply.code, reply.message, peer=at.hop.peer_id))
            if asked == step:
                return reply, body
        raise HopFailure(last.hop, MalformedFrameError(f"step {step} was never asked of {last.hop}"))

    async def _read_start_ack(self, step: int) -> None:
        """The first hop's reply to the ring's start: its PushAck once the whole route ran it, or
        an ErrorReply naming the hop at fault."""
        first = self.links[0]
        try:
            reply, body = await read_reply(first)
            while isinstance(reply, ForwardResult):  # its own reply of the start comes first
                self._keep(0, reply, body)
                reply, body = await read_reply(first)
        except Exception as e:
            raise HopFailure(first.hop, e) from e
        if isinstance(reply, ErrorReply):
            at = blamed_hop(reply.failed_peer, self.links[1:], first, peer_of=peer_of)
            raise HopFailure(at.hop, error_from_reply(reply.code, reply.message, peer=at.hop.peer_id))
        if not isinstance(reply, PushAck) or reply.step != step:
            raise HopFailure(first.hop, MalformedFrameError(f"expected the PushAck of step {step}, got {reply!r:.80}"))

    async def drain(self) -> None:
        """Let the ring halt (no more credit) and read every answer still coming, so the route's
        streams carry nothing else; HopFailure if the ring broke meanwhile."""
        if not self.active:
            return
        self.active = False
        last = self.links[-1]
        if not self._asked or self._asked[-1] < self._credit:  # the ring may run to the credit: ask for it
            self._asked.append(self._credit)
            await write_to(last, AwaitResult(session_id=last.session_id, step=self._credit, ring_until=self._credit))
        final = self._asked[-1]
        reply, _ = await self._unless_start_failed(self._read_until(final))
        await self._started()
        stopped = isinstance(reply, RingStopped)
        if not (stopped or isinstance(reply, ForwardResult)) or (stopped and reply.step > final):
            raise HopFailure(last.hop, MalformedFrameError(f"{last.hop} answered a wait with {reply!r:.80}"))
        ran_to = reply.step if stopped else final
        if ran_to > self._consumed:  # the earlier hops sent their replies of the steps run past
            for i, link in enumerate(self.links[:-1]):
                try:
                    await self._report(i, ran_to)
                except Exception as e:
                    raise HopFailure(link.hop, e) from e
        self._consumed = ran_to

    def cancel(self) -> None:
        """The route is being dropped: stop reading."""
        self.active = False
        if self._start_ack is not None:
            self._start_ack.cancel()

