"""Service receipts: a peer's signed acknowledgement that it opened a session for a client.

A ``ServiceReports`` record is as honest as its reporter, and reporters are free keys. So a
report on a peer counts only when it carries that peer's receipt for the reporter: the peer signs
``(its peer id, the client's peer id)`` with its reply key (the Ed25519 key ``PeerInfo.reply_key``
announces) when it opens a session for a stream whose authenticated remote is that client
(``SessionOpened.receipt``). The client keeps the latest receipt per peer and attaches it to what
it reports on that peer (``ObservedRate.receipt``); the coordinator drops report entries without
a valid one (``coordinator/claims.py``). A key that never opened a session on a peer cannot
report on it; one that did can still report a false rate, as one reporter address among others.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from p2pserve.types import PeerId

#: Bytes of a receipt (an Ed25519 signature); a receipt of any other length is not one.
RECEIPT_BYTES = 64
_DOMAIN = b"p2pserve-service-receipt\x00"


def receipt_message(peer_id: PeerId, client_id: PeerId) -> bytes:
    """What a receipt signs: the serving peer's id and the served client's id, under a domain tag
    (no reply claim or other signed message can be read as one)."""
    return _DOMAIN + peer_id.encode() + b"\x00" + client_id.encode()


def sign_receipt(key: Ed25519PrivateKey, peer_id: PeerId, client_id: PeerId) -> bytes:
    """``peer_id``'s receipt for ``client_id`` under its reply key ``key``."""
    return key.sign(receipt_message(peer_id, client_id))


def verify_receipt(reply_key_hex: str, peer_id: PeerId, client_id: PeerId, receipt: bytes) -> bool:
    """Whether ``receipt`` is ``peer_id``'s receipt for ``client_id`` under the reply key it
    announces (``reply_key_hex``; "" or malformed: no receipt can be valid)."""
    if len(receipt) != RECEIPT_BYTES or not reply_key_hex:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(reply_key_hex)).verify(receipt, receipt_message(peer_id, client_id))
    except (InvalidSignature, ValueError):
        return False
    return True
