"""A hop of a pipeline: one peer running a span of layers; and the one parser of peer entries.

Pure: routing (:mod:`p2pserve.client.routing`), the simulator and the process launcher use it
without touching the network.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from p2pserve.errors import ConfigError, RoutingError
from p2pserve.types import PeerId

#: A peer given by hand: ``(multiaddr, start, end)`` or ``'MULTIADDR@START:END'``; the multiaddr
#: ends with ``/p2p/<peer id>``.
PeerEntry = Union[str, tuple[str, int, int]]


@dataclass(frozen=True)
class Hop:
    """Run layers [start, end) on ``peer_id`` (reachable at ``maddrs``)."""

    peer_id: PeerId
    start: int
    end: int
    maddrs: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.peer_id[-8:]}[{self.start}:{self.end})"


def parse_peer(entry: PeerEntry) -> Hop:
    """The hop covering a peer's whole range, from ``(maddr, start, end)`` or ``'MADDR@START:END'``."""
    if isinstance(entry, str):
        maddr, sep, span = entry.rpartition("@")
        if not sep or ":" not in span:
            raise ConfigError(f"peer {entry!r}: expected MULTIADDR@START:END")
        start, end = span.split(":", 1)
    else:
        maddr, start, end = entry
    if "/p2p/" not in maddr:
        raise ConfigError(f"peer address {maddr!r} must end with /p2p/<peer id>")
    try:
        start, end = int(start), int(end)
    except ValueError:
        raise ConfigError(f"peer {entry!r}: layer range must be integers") from None
    if not 0 <= start < end:
        raise ConfigError(f"peer {entry!r}: invalid layer range [{start}, {end})")
    return Hop(maddr.rsplit("/p2p/", 1)[1], start, end, (maddr,))


def check_chain(hops: list[Hop], num_layers: int) -> None:
    """Raise RoutingError unless hops cover [0, num_layers) contiguously."""
    if not hops:
        raise RoutingError("empty chain")
    at = 0
    for hop in hops:
        if hop.start != at or hop.end <= hop.start:
            raise RoutingError(f"chain is not contiguous at layer {at}: {' -> '.join(map(str, hops))}")
        at = hop.end
    if at != num_layers:
        raise RoutingError(f"chain ends at layer {at}, the model has {num_layers}")
