"""``RouteForwarding``: a pipeline's peer-to-peer forwarding, grouped in one collaborator.

It holds the push rule (a :class:`~p2pserve.client.push.PushConfig`), the current route's push
state (:class:`~p2pserve.client.push.PushedRoute`) or ring (:class:`~p2pserve.client.ring.RingRoute`),
the bounds of a ring (set per step by the generation, :meth:`limit_ring`) and the counts of the
steps that went peer to peer. The pipeline decides *whether* a step is pushed (its route is
not verified, the rule says so) and hands such a step here.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

from p2pserve.client.connection import HopConnection
from p2pserve.client.push import PushedRoute
from p2pserve.config import PushConfig
from p2pserve.client.ring import RingRoute
from p2pserve.protocol import Forward


class RouteForwarding:
    """Push and ring state of one pipeline (``max_length``: the positions its session holds)."""

    def __init__(self, config: PushConfig, max_length: int):
        self.config = config
        self.max_length = max_length
        self.pushed: Optional[PushedRoute] = None  # the current route's push state, once it pushed
        self.ring: Optional[RingRoute] = None  # the current route's ring, once it ran one
        # a ring's bounds: the last input position it may need and its stop token ids; None: no
        # ring for this step (speculative drafting)
        self.ring_limit: Optional[tuple[int, frozenset]] = (max_length - 1, frozenset())
        self.refused = False  # a hop of the current route takes no push-mode steps: drive it
        self.pushed_steps = 0  # steps that went peer to peer (push mode), for tests and reports
        self.ring_steps = 0  # steps whose token came round a ring, for tests and reports

    def limit_ring(self, limit: Optional[tuple[int, frozenset]]) -> None:
        """Bound the next steps' ring: (last input position, stop token ids), or None for none."""
        self.ring_limit = limit

    def use(self, links: Sequence[HopConnection], verified: bool, outputs: int = 1, history: bool = False) -> bool:
        """Whether a step over ``links`` is pushed (see ``PushConfig.use_push``). A lone hop
        takes only ring steps (its PushForward and AwaitResult share one stream): one output,
        and a ring allowed (``limit_ring``); so does a verified route (a ring shows the client
        every hop's input and output, a plain push only the last hop's), and a session whose
        last hop needs its token ``history`` (a ring's last hop keeps it: ``RingGrant.context``)."""
        if self.refused:
            return False
        ringed = outputs == 1 and self.ring_limit is not None and (self.config.ring or len(links) == 1)
        if (len(links) == 1 or verified or history) and not ringed:  # only a ring shows a verified step's every hop
            return False
        return self.config.use_push(len(links), verified, [c.open_rtt_s for c in links])

    async def step(self, links: Sequence[HopConnection], msg: Forward, sent: list[int], data, held: int,
                   vocab_size: Optional[int], timed=None, history: bool = False):
        """Push mode (:mod:`p2pserve.client.push`): one PushForward to the first hop, forwarded
        peer to peer; the hops are allowed to push into each other's sessions once per route.
        As a ring (:mod:`p2pserve.client.ring`) when the config and the step allow it; with
        ``history``, a ring's start gives the last hop ``sent`` as its context.
        ``timed`` (a histogram) observes the step's time."""
        t0 = time.perf_counter()
        if (self.config.ring or len(links) == 1) and msg.outputs == 1 and self.ring_limit is not None:
            reply = await self._ring_step(links, msg, sent, data, held, vocab_size, history)
        else:
            if self.ring is not None:  # the hops' grants admit only ring steps: grant afresh
                await self.ring.drain()
                self.ring, self.pushed = None, None
            if self.pushed is None:
                self.pushed = PushedRoute(links)
            reply = await self.pushed.step(msg, data, len(sent), vocab_size)
        self.pushed_steps += 1
        if timed is not None:
            timed.observe(time.perf_counter() - t0)
        return reply

    async def _ring_step(self, links, msg: Forward, sent: list[int], data, held: int, vocab_size: Optional[int],
                         history: bool = False):
        """The ring's next token when ``sent`` is the token the ring already has; else (re)start
        the ring with this step, within ``ring_limit``."""
        if self.ring is None:
            if self.pushed is not None:  # the first hop's last ack, read before the ring uses its stream
                await self.pushed.settle()
                self.pushed = None
            self.ring = RingRoute(links, self.config.window)
        if self.ring.continues(sent, held, msg.step):
            self.ring_steps += 1
            return await self.ring.next(vocab_size)
        last_position, stop = self.ring_limit
        return await self.ring.start(msg, data, len(sent), vocab_size, min(last_position, self.max_length - 1), stop,
                                     sent if history else None)

    def hop_replies(self) -> list:
        """The latest ring step's (reply, payload) of every hop in route order; [] when the
        latest step was not a ring's (a plain push shows the client the last hop only)."""
        return self.ring.hop_replies if self.ring is not None and self.ring.active else []

    def tape(self, trust, position: int, sent: list[int], dtype: str, inputs, history: bool) -> None:
        """Record the latest ring step (``sent`` at ``position``, ``inputs`` as ``dtype`` bytes)
        on ``trust``'s tapes as a driven step is: each hop's input and signed output, and the
        last hop's context where it kept the session's ``history``."""
        replies = self.hop_replies()
        for i, (reply, payload) in enumerate(replies):
            context = sent if history and i == len(replies) - 1 else None
            trust.record(i, position, len(sent), dtype, inputs, reply, payload, context)
            if reply.tensor is not None:
                inputs, dtype = payload, reply.tensor.dtype

    def route_opened(self) -> None:
        """A new route: nothing pushed on it yet."""
        self.pushed, self.ring, self.refused = None, None, False

    async def route_left(self, settle_s: float) -> None:
        """The pipeline leaves the route: the first hop's last ack is read (up to ``settle_s``)
        before its sessions are closed, and a ring is cancelled."""
        if self.pushed is not None:
            await self.pushed.settle(settle_s)
        if self.ring is not None:
            self.ring.cancel()
        self.pushed, self.ring = None, None
