"""``VerifiedSession``: the :class:`~p2pserve.client.trust.protocol.StepTrust` of one pipeline
over a client's :class:`~p2pserve.client.trust.verifier.Verifier` (or a stand-in with its
``masks``/``after_step``/``route_done``/``excluded``, such as ``testing.ScriptedVerifier``).

It keeps the route's tapes (one :class:`~p2pserve.client.trust.tape.HopTape` per hop) and the
pipeline's :class:`~p2pserve.client.trust.rollback.Suspects`.
"""

from __future__ import annotations

import asyncio
from typing import Optional, Sequence

from p2pserve.client.trust.rollback import Suspects
from p2pserve.client.trust.tape import HopTape


class VerifiedSession:
    """One pipeline's view of ``verifier``; ``tape_steps``: record routes' exchanges (False when
    nothing is sampled, ``verify_share`` 0)."""

    def __init__(self, verifier, tape_steps: bool = True):
        self.verifier = verifier
        self.tape_steps = tape_steps
        self.tapes: list[HopTape] = []  # per hop of the route: what it consumed and returned
        self.suspects = Suspects()  # who touched which outputs; the checks drawn (trust/rollback.py)

    @property
    def taping(self) -> bool:
        """Whether the current route's exchanges are recorded."""
        return bool(self.tapes)

    def masks(self, masks):
        """``masks`` with the verifier's excluded peers banned."""
        return self.verifier.masks(masks)

    def route_opened(self, links: Sequence) -> None:
        """Start a tape per hop of the new route."""
        if self.tape_steps:
            self.tapes = [HopTape(c.hop, c.session_id) for c in links]

    def forked(self, parent, positions: int) -> None:
        """Each hop's tape starts with the parent's inputs at [0, ``positions``) (unsigned here:
        compared by no check, but replayed and committed to); without them a witness would
        replay a history missing its start, so the route then goes unrecorded."""
        theirs = getattr(parent, "tapes", None)
        if not self.tapes:
            return
        if not theirs or len(theirs) != len(self.tapes):
            self.tapes = []
            return
        for mine, tape in zip(self.tapes, theirs):
            mine.seed(tape.inputs_before(positions), positions)

    def record(self, hop: int, position: int, count: int, dtype: str, inputs, reply, payload, context=None,
               allowed=None) -> None:
        """Append one exchange to hop ``hop``'s tape (with the last hop's context and mask)."""
        self.tapes[hop].record(position, count, dtype, inputs, reply, payload, context, allowed)

    def after_step(self, sampling) -> None:
        """Let the verifier draw this step's hops to check (and note who touched its outputs)."""
        if self.tapes:
            self.verifier.after_step(self.tapes, sampling, self.suspects)

    def route_done(self) -> None:
        """Start the checks drawn on the route's hops; the route is no longer taped."""
        if self.tapes:
            self.verifier.route_done(self.tapes, self.suspects)
        self.tapes = []

    def rollback_from(self) -> Optional[int]:
        """The first output position touched by a peer the verifier excluded, or None."""
        excluded = self.verifier.excluded
        return self.suspects.since(excluded) if excluded else None

    def forget_caught(self) -> None:
        """Stop tracking the excluded peers."""
        self.suspects.forget(self.verifier.excluded)

    async def settle(self) -> None:
        """Wait for every check drawn on this pipeline's steps."""
        checks = self.suspects.checks
        while checks:
            await asyncio.gather(*list(checks), return_exceptions=True)
