"""Service receipts (dht/receipts.py): what a peer signs for a client, and what a report carries."""

from __future__ import annotations

from p2pserve.client.trust.observer import ServiceObserver
from p2pserve.dht.receipts import verify_receipt
from p2pserve.peer.reply_signer import ReplySigner


def test_a_receipt_verifies_only_for_its_peer_client_and_key():
    peer, other = ReplySigner("QmPeer", "m"), ReplySigner("QmOther", "m")
    r = peer.receipt("QmClient")
    assert verify_receipt(peer.public_text, "QmPeer", "QmClient", r)
    assert not verify_receipt(peer.public_text, "QmPeer", "QmSybil", r)  # another client's
    assert not verify_receipt(other.public_text, "QmPeer", "QmClient", r)  # another key
    assert not verify_receipt(peer.public_text, "QmOther", "QmClient", r)  # another peer
    assert not verify_receipt("", "QmPeer", "QmClient", r) and not verify_receipt(peer.public_text, "QmPeer",
                                                                                 "QmClient", r[:-1])
    assert not verify_receipt("zz" * 32, "QmPeer", "QmClient", r)  # not a key


def test_the_observer_reports_each_peer_with_its_receipt():
    obs = ServiceObserver(clock=lambda: 100.0)
    peer = ReplySigner("QmPeer", "m")
    obs.rtt("QmPeer", 4, 0.001)
    obs.receipt("QmPeer", peer.receipt("QmMe"))
    obs.decode("QmPeer", 4, 0.01)
    obs.decode("QmBare", 4, 0.01)  # a peer that gave none: reported without one
    rep = obs.report("QmMe", "m", [])
    by = {r.peer_id: r for r in rep.rates}
    assert verify_receipt(peer.public_text, "QmPeer", "QmMe", by["QmPeer"].receipt)
    assert by["QmBare"].receipt == b""
    rep.validate()
