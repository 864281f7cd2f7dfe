"""Rolling a request back past the outputs of a peer that verification caught.

Verification (``client/verifier.py``) runs off the critical path, so by the time a check proves a
peer wrong, the request that carried its output may have moved on. A :class:`Suspects` per
pipeline remembers, for every peer of its routes, the first output position it had a hand in:
the position of the token returned by the first step through it. Every later token was computed
from that peer's hidden states (its KV cache), so when the peer is caught, every token from that
position on is suspect and is generated again on a route without it. Peers sample with a seed per
absolute position, so the regenerated tokens are those an honest route returns: greedy and seeded
output stays identical to ``generate``.

Why the first output and not the first step proven bad: a screen of hidden states proves every
earlier step of the checked session good, but a last hop's token check compares only the drawn
step, and another pipeline that used the same peer was not checked at all. Rolling back to the
first output the peer touched is right in every case, at the cost of regenerating a few more
tokens.

``ClientConfig.verify_hold`` (off by default) makes a request wait, before it completes, for the
checks drawn on its own steps: its route is closed, the checks due on its hops run, and a
culprit among them rolls the request back (:func:`settle`). Without it only checks that finish
while the request still runs can roll it back; a request whose own checks land later is left as
it was (docs/trust.md, "Threat model").
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping, Optional, Protocol


class Suspects:
    """One pipeline's record of who touched which outputs, and the checks drawn on its steps."""

    def __init__(self) -> None:
        self.first_out: dict[str, int] = {}  # peer id -> position of the first token it helped compute
        self.checks: set[asyncio.Task] = set()  # verifier tasks drawn on this pipeline's steps

    def stepped(self, tapes) -> None:
        """A step went through the hops of ``tapes`` (``client.tape.HopTape``, route order): each
        hop's peer touched the first token the last hop returned, and every later one."""
        last = tapes[-1].last if tapes else None
        if last is None:
            return
        tokens = getattr(last.reply, "tokens", None)  # a speculative step returns several
        out = last.inputs.position + last.inputs.count - (len(tokens) if tokens else 1) + 1
        for tape in tapes:
            self.first_out.setdefault(tape.hop.peer_id, out)

    def since(self, excluded: Mapping[str, str]) -> Optional[int]:
        """The first output position touched by a peer in ``excluded``, or None."""
        hit = [pos for peer, pos in self.first_out.items() if peer in excluded]
        return min(hit) if hit else None

    def forget(self, excluded: Mapping[str, str]) -> None:
        """Stop tracking the caught peers (after a rollback: their outputs are gone)."""
        for peer in [p for p in self.first_out if p in excluded]:
            del self.first_out[peer]


class Audited(Protocol):
    """What rollback reads of a pipeline (``client/pipeline.py``): its verifier (None when outputs
    are not verified; else one with the ``excluded`` peers it caught) and ``suspects``."""

    verifier: Any
    suspects: Suspects


def suspect_from(pipeline: Audited) -> Optional[int]:
    """The position from which ``pipeline``'s outputs must be regenerated, or None (no verifier,
    or no peer of its routes caught)."""
    verifier = pipeline.verifier
    if verifier is None or not verifier.excluded:
        return None
    return pipeline.suspects.since(verifier.excluded)


async def settle(pipeline) -> None:
    """Close ``pipeline``'s route (its due checks start) and wait for every check drawn on its
    steps (``ClientConfig.verify_hold``). Costs the request one witness replay of each due hop's
    history; a later step re-opens a route and replays the history to it."""
    await pipeline.close()
    checks = pipeline.suspects.checks
    while checks:
        await asyncio.gather(*list(checks), return_exceptions=True)
