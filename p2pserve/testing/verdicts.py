"""A scripted stand-in for the client's verifier, for unit tests of what a conviction does.

:class:`ScriptedVerifier` checks nothing: it convicts ``peer`` once ``after`` steps were done,
as a background check that proved it wrong would (``client/trust/verifier.py``), and otherwise plays
the verifier's part for a pipeline: masks, the record of who touched which outputs.
"""

from __future__ import annotations

from dataclasses import replace

from p2pserve.client.trust.session import VerifiedSession


class ScriptedVerifier:
    """Convicts ``peer`` after ``after`` steps (of all pipelines together)."""

    def __init__(self, peer: str, after: int):
        self.peer, self.after, self.steps = peer, after, 0
        self.excluded: dict[str, str] = {}

    def session(self, tape_steps: bool = True) -> VerifiedSession:
        """A pipeline's view of this stand-in (as ``Verifier.session``)."""
        return VerifiedSession(self, tape_steps)

    def masks(self, masks):
        """``masks`` with the convicted peers banned."""
        return replace(masks, banned=masks.banned | frozenset(self.excluded))

    def after_step(self, tapes, sampling, suspects=None) -> None:
        """Note who touched the step's outputs; convict ``peer`` at the scripted step."""
        if suspects is not None:
            suspects.stepped(tapes)
        self.steps += 1
        if self.steps == self.after:
            self.excluded[self.peer] = "scripted conviction"

    def route_done(self, tapes, suspects=None) -> None:
        """Nothing is checked."""
