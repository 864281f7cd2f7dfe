"""LinkDialer: few dials to one next hop at once, and a dial refused for the stream count tried again."""

from __future__ import annotations

import asyncio

import pytest

from p2pserve.errors import OverloadedError
from p2pserve.peer.link_dialer import LinkDialer, dial_concurrency


class _NextHops:
    """A transport whose dials take ``hold_s`` each; the first ``refusals`` are refused as a peer
    at its stream bound refuses them. Counts the dials under way per peer id."""

    def __init__(self, hold_s: float = 0.0, refusals: int = 0):
        self.hold_s, self.refusals = hold_s, refusals
        self.under_way: dict[str, int] = {}
        self.most: dict[str, int] = {}
        self.dials = 0

    async def open_stream(self, peer_id, maddrs, protocol, timeout_s):
        self.dials += 1
        self.under_way[peer_id] = self.under_way.get(peer_id, 0) + 1
        self.most[peer_id] = max(self.most.get(peer_id, 0), self.under_way[peer_id])
        try:
            await asyncio.sleep(self.hold_s)
            if self.refusals > 0:
                self.refusals -= 1
                raise OverloadedError("you already have 4 streams open to this peer")
            return f"stream to {peer_id}"
        finally:
            self.under_way[peer_id] -= 1


def test_dials_to_one_next_hop_are_bounded_and_others_are_not_held_up():
    hops = _NextHops(hold_s=0.01)
    dialer = LinkDialer(hops, concurrency=2, timeout_s=5.0)

    async def main():
        return await asyncio.gather(*(dialer.dial(p, ()) for p in ["B"] * 8 + ["C"] * 2))

    streams = asyncio.run(main())
    assert streams == ["stream to B"] * 8 + ["stream to C"] * 2
    assert hops.most == {"B": 2, "C": 2}
    assert dialer._gates == {} and not dialer._users  # nothing kept for next hops no longer dialled


def test_a_dial_refused_for_the_stream_count_is_tried_again():
    hops = _NextHops(refusals=3)
    stream = asyncio.run(LinkDialer(hops, concurrency=1, timeout_s=5.0).dial("B", ()))
    assert stream == "stream to B" and hops.dials == 4


def test_refusals_past_the_timeout_raise_the_last_one():
    hops = _NextHops(refusals=10**6)
    with pytest.raises(OverloadedError):
        asyncio.run(LinkDialer(hops, concurrency=1, timeout_s=0.3).dial("B", ()))
    assert 2 <= hops.dials < 20


def test_concurrency_leaves_half_of_the_next_hops_allowance_free():
    assert dial_concurrency(256) == 64 and dial_concurrency(4) == 1 and dial_concurrency(1) == 1
