"""Which hop to blame when a forwarded step fails somewhere down the route.

A hop that forwards (push or ring) reports a failure with the ``failed_peer`` it was told or
saw. Nobody can check a blame of a hop it never talked to, so one rule holds everywhere: a
named hop is believed only if it is one of the hops after the reporter's next one (who could
be at fault without the next one being so); otherwise the nearest hop (the one the reporter
talks to) is blamed. A lying hop can therefore shift blame only onto the hops after it.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, TypeVar

H = TypeVar("H")


def blamed_hop(named: Optional[str], later: Iterable[H], nearest: H,
               peer_of: Callable[[H], str] = lambda hop: hop) -> H:  # type: ignore[assignment, return-value]
    """The hop of ``later`` whose peer id (``peer_of(hop)``) is ``named``, else ``nearest``."""
    if named is not None:
        for hop in later:
            if peer_of(hop) == named:
                return hop
    return nearest
