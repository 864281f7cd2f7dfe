"""Ring mode on the peer, the pure part: what a granted ring lets each hop accept, and when the
last hop pushes the next step to the first (docs/wan.md, "Ring").

In a ring the last hop, once it sampled the token of step ``s``, answers the owner's
``AwaitResult`` and pushes step ``s + 1`` (that token as input) straight to the first hop, so a
decode token crosses ``h`` links instead of push's ``h + 1``. The owner bounds the ring in the
``RingGrant`` it gives every hop (``AllowPush.ring``): the first step (its own push), then one
token per step at consecutive positions up to ``max_position``, each step once and in order.
Every hop checks the steps it gets against its own grant, so a peer can make another run no more
than the owner allowed, whatever it sends. The last hop also stops after a stop token, and past
the owner's credit (``AwaitResult.ring_until``: the client lets the ring run at most a step
ahead of what it asked for, so a stop string it finds stops the ring within a step or two).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from p2pserve.errors import BadRequestError
from p2pserve.protocol import MAX_RING_AHEAD, ErrorReply, Forward, RingGrant


def check_grant(grant: RingGrant, from_peer: str, self_id: str) -> None:
    """Raise BadRequestError unless ``grant`` is one ring's grant for one role: the first hop
    (``route``: the rest of the ring, ending at ``from_peer``), the last (``successor``), a hop
    between them (neither), or a peer holding the whole route, which loops on itself (no route,
    itself as successor and as the granted peer); bounds that hold at least the first step."""
    g = grant
    if g.max_position < g.start_position + g.start_tokens - 1:
        raise BadRequestError("a ring's max_position is before the end of its first step")
    if g.context is not None and (g.successor is None or len(g.context) != g.start_tokens):
        raise BadRequestError("a ring's context is the last hop's, and holds its first step's token ids")
    if is_loop(g, self_id):
        if from_peer != self_id:
            raise BadRequestError("a ring of one hop is granted to that hop itself")
        return
    if g.route:
        peers = [h.peer_id for h in g.route]
        if g.route[-1].peer_id != from_peer or self_id in peers or len(set(peers)) != len(peers):
            raise BadRequestError("a ring's route must end at the peer that closes it, and name no peer twice")
    if g.successor is not None and g.successor.peer_id == self_id:
        raise BadRequestError("a ring's last hop cannot be its own successor")


def is_loop(grant: RingGrant, self_id: str) -> bool:
    """Whether ``grant`` makes this peer the whole ring: it samples each token and runs the next
    step itself, with no network between steps."""
    return not grant.route and grant.successor is not None and grant.successor.peer_id == self_id


def ring_position(grant: RingGrant, step: int) -> int:
    """The position a ring's ``step`` starts at: the first step at ``start_position``, each
    later one a token after the one before (positions are absolute)."""
    if step == grant.start_step:
        return grant.start_position
    return grant.start_position + grant.start_tokens + (step - grant.start_step - 1)


@dataclass
class RingState:
    """One session's ring at this hop: the grant, the next step it accepts from the granted peer,
    and (at the last hop) the owner's credit and how the ring ended."""

    grant: RingGrant
    from_peer: str
    next_step: int
    credit: int = 0  # last hop: the highest step the owner let the ring run to
    last_run: int = -1  # last hop: the latest step it ran
    paused: Optional[tuple[int, int, int]] = None  # last hop: (step, position, token) held for credit
    ended_after: Optional[int] = None  # last hop: the ring stopped after this step
    failure: Optional[ErrorReply] = None  # the ring broke here or after: the first report of it
    upstream: object = None  # non-last hops: the writer of the stream the latest ring step came on
    stop: frozenset = field(default_factory=frozenset)
    loop: bool = False  # this peer is the whole ring: it runs each next step itself
    runner: object = None  # a loop: the peer's own Forward path, which runs its next steps
    fed: Optional[tuple[int, int]] = None  # last hop: (step, token) it pushed as that step's input

    def context_of(self, fwd: Forward) -> Optional[list[int]]:
        """Last hop, where the grant carries a context (the session's penalties need its token
        history): the token ids of ring step ``fwd`` (``Forward.context``): the first step's from
        the grant, a later one's the token this hop sampled and pushed as its input. None where
        none applies (the step then runs without, and a session that needs it is refused)."""
        if self.grant.context is None:
            return None
        if fwd.step == self.grant.start_step:
            return list(self.grant.context)
        return [self.fed[1]] if self.fed is not None and self.fed[0] == fwd.step else None

    @classmethod
    def of(cls, grant: RingGrant, from_peer: str, self_id: str = "") -> "RingState":
        """A fresh ring: the first hop expects the last hop's first step (the owner pushes the
        ring's start itself); every other hop expects the start."""
        first = bool(grant.route)
        return cls(grant, from_peer, grant.start_step + (1 if first else 0), stop=frozenset(grant.stop_tokens),
                   loop=is_loop(grant, self_id))

    @property
    def first(self) -> bool:
        """Whether this hop opens the ring (its ring steps come from the last hop)."""
        return bool(self.grant.route)

    @property
    def last(self) -> bool:
        """Whether this hop closes the ring (it pushes the next step to the first hop)."""
        return self.grant.successor is not None

    def admit(self, fwd: Forward, n: int, token: Optional[int]) -> None:
        """Accept ``fwd`` (``n`` positions; ``token`` its input when it is one token id) from the
        granted peer as the ring's next step, or raise BadRequestError."""
        g, step = self.grant, fwd.step
        if step != self.next_step:
            raise BadRequestError(f"ring step {step} out of order: expected step {self.next_step}")
        want_n = g.start_tokens if step == g.start_step else 1
        if n != want_n or fwd.position != ring_position(g, step) or fwd.outputs != 1:
            raise BadRequestError(f"ring step {step} must be {want_n} position(s) at {ring_position(g, step)}")
        if fwd.position + n - 1 > g.max_position:
            raise BadRequestError(f"ring step {step} runs past the granted max_position {g.max_position}")
        if self.first and (token is None or token in self.stop):
            raise BadRequestError(f"ring step {step} follows a stop token: the ring has ended")
        self.next_step = step + 1

    def after(self, step: int, next_position: int, token: int) -> str:
        """The last hop ran ``step``, sampling ``token``; the next step would start at
        ``next_position``. "push" it, "pause" for the owner's credit, or "stop" the ring."""
        self.last_run = max(self.last_run, step)
        if token in self.stop or next_position > self.grant.max_position:
            self.ended_after = step
            return "stop"
        if step + 1 > self.credit:
            self.paused = (step + 1, next_position, token)
            return "pause"
        return "push"

    def resume(self, credit: int, waited: int) -> Optional[tuple[int, int, int]]:
        """Raise the owner's credit (at most ``MAX_RING_AHEAD`` steps past ``waited``, the step
        it waits for); the paused step (step, position, token) it now lets go on."""
        self.credit = max(self.credit, min(credit, waited + MAX_RING_AHEAD))
        if self.paused is not None and self.paused[0] <= self.credit and self.failure is None:
            paused, self.paused = self.paused, None
            return paused
        return None
