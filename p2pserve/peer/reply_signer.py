"""The peer's side of signed replies: each session's input commitment and the reply signature.

:class:`ReplySigner` holds the peer's Ed25519 reply key (derived from its identity key by the
agent, or a throwaway one for a peer that announces nothing) and signs one
:class:`~p2pserve.dht.evidence.ReplyClaim` per ``ForwardResult``. The session's
:class:`~p2pserve.dht.evidence.InputChain` is advanced by the handler before each step runs.
"""

from __future__ import annotations

from typing import Optional

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from p2pserve.dht.claim_extras import extras_digest, returned_digest
from p2pserve.dht.evidence import InputChain, make_claim, output_digest, reply_key_text, row_digests, sign_claim
from p2pserve.dht.receipts import sign_receipt
from p2pserve.types import PeerId


class ReplySigner:
    """Signs this peer's replies; ``public_text`` is what ``PeerInfo.reply_key`` announces."""

    def __init__(self, peer_id: PeerId, model_id: str, key: Optional[Ed25519PrivateKey] = None, dtype: str = "float32"):
        self.peer_id = peer_id
        self.model_id = model_id
        self.dtype = dtype  # the compute dtype: hidden inputs and outputs travel in it
        self.key = key if key is not None else Ed25519PrivateKey.generate()
        self.public_text = reply_key_text(self.key)

    def use_key(self, key: Ed25519PrivateKey) -> None:
        """Sign with ``key`` from now on (the agent's key derived from the peer's identity)."""
        self.key, self.public_text = key, reply_key_text(key)

    def receipt(self, client_id: PeerId) -> bytes:
        """This peer's service receipt for ``client_id`` (``dht/receipts.py``)."""
        return sign_receipt(self.key, self.peer_id, client_id)

    @staticmethod
    def consume(chain: InputChain, position: int, payload, n: int) -> bytes:
        """Commit a Forward's ``n`` input rows at ``position`` (a rewind, or the remains of a
        step that failed, are dropped first); returns ``c[position + n]``."""
        chain.truncate(position)
        return chain.extend(row_digests(payload, n))

    def sign(self, session, position: int, count: int, commitment: bytes, payload=b"",
             token: Optional[int] = None, kind: str = "hidden", allowed: Optional[bytes] = None,
             returned: Optional[dict] = None) -> bytes:
        """The signature over the claim of one reply of ``session`` (a peer ``Session``): ``kind``
        is "hidden" (``payload`` the hidden-state bytes), "token" (``token``) or "tokens"
        (``payload`` their ``tokens_bytes``); the session's sampling parameters are bound too,
        and for tokens the rest that decided them (``dht/claim_extras.py``): the session's token
        history through this step, the grammar's mask ``allowed``, and the log-probabilities
        ``returned`` (``logprobs`` / ``prompt_logprobs``)."""
        extras = carried = b""
        if kind != "hidden":
            got = returned or {}
            extras = extras_digest(session.sampling, session.tokens[:position + count], allowed)
            carried = returned_digest(got.get("logprobs"), got.get("prompt_logprobs"))
        claim = make_claim(model=self.model_id, peer_id=self.peer_id, session_id=session.id, start=session.start,
                           end=session.end, position=position, count=count, commitment=commitment,
                           output=output_digest(payload, token), kind=kind, dtype=self.dtype,
                           sampling=session.sampling, extras=extras, returned=carried)
        return sign_claim(self.key, claim)
