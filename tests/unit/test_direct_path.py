"""Pure parts of the direct TCP path: one-time tokens and the addresses it binds and dials."""

from __future__ import annotations

from p2pserve.peer.direct import TokenBook
from p2pserve.transport import maddr_hosts


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_tokens_are_single_use_and_expire():
    clock = Clock()
    book = TokenBook(ttl_s=30.0, clock=clock)
    a, b = book.issue(), book.issue()
    assert a != b and len(a) == 32
    assert book.redeem(a) and not book.redeem(a)  # one use
    assert not book.redeem("0" * 32)  # never issued
    clock.t += 31
    assert not book.redeem(b)  # expired


def test_token_book_is_bounded():
    clock = Clock()
    book = TokenBook(ttl_s=30.0, clock=clock, max_outstanding=8)
    tokens = [book.issue() for _ in range(50)]
    assert len(book._expiry) <= 8
    assert book.redeem(tokens[-1])  # the newest survive


def test_maddr_hosts_skips_relays_and_repeats():
    maddrs = [
        "/ip4/127.0.0.1/tcp/4001/p2p/QmA",
        "/ip4/127.0.0.1/udp/4001/quic/p2p/QmA",
        "/ip6/::1/tcp/4001/p2p/QmA",
        "/ip4/1.2.3.4/tcp/4001/p2p/QmRelay/p2p-circuit/p2p/QmA",
        "/dns4/example.org/tcp/4001",
    ]
    assert maddr_hosts(maddrs) == ["127.0.0.1", "::1"]
