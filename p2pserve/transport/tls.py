"""TLS 1.3 for the direct path, pinned by a fingerprint sent over the authenticated libp2p stream.

A peer's direct listener serves TLS 1.3 only, with a key pair and self-signed certificate made
fresh at start (:meth:`DirectTLS.generate`). No CA vouches for it: the client learns the SHA-256
of that certificate from the ``DirectOffer`` it read on the libp2p stream, which libp2p
authenticates to the peer id, and accepts a TLS endpoint only if it presents exactly that
certificate (:func:`check_pin`). The client checks this after the handshake and before it writes
any byte of application data, so an impostor at an announced address gets the client's half of
a TLS handshake and nothing else; the one-time token and every session frame travel encrypted to
the genuine peer only.

The client sends no certificate: the peer knows who it serves from the token, which it issued on
the libp2p stream to an authenticated peer id.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import ssl
import tempfile
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

#: Hex digits in a SHA-256 fingerprint.
FINGERPRINT_HEX = 64


def fingerprint(der_cert: bytes) -> str:
    """SHA-256 of a DER certificate, lowercase hex (what ``DirectOffer.tls_sha256`` carries)."""
    return hashlib.sha256(der_cert).hexdigest()


def _self_signed(key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
    # The name is decoration: nobody checks it (the fingerprint is the identity).
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "p2pserve direct path")])
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))  # tolerate clients with a slow clock
        .not_valid_after(now + datetime.timedelta(days=3650))  # the pin, not the date, is checked
        .sign(key, hashes.SHA256())
    )


@dataclass(frozen=True)
class DirectTLS:
    """A direct listener's TLS identity: its server context and its certificate's fingerprint."""

    context: ssl.SSLContext
    fingerprint: str

    @classmethod
    def generate(cls) -> "DirectTLS":
        """A fresh ECDSA P-256 key and self-signed certificate, loaded into a TLS 1.3-only context."""
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _self_signed(key)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        # ``load_cert_chain`` reads only files: write them to a private directory, load, delete.
        with tempfile.TemporaryDirectory(prefix="p2pserve-tls-") as tmp:
            cert_path, key_path = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
            with open(cert_path, "wb") as f:
                f.write(cert.public_bytes(serialization.Encoding.PEM))
            with open(os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
            context.load_cert_chain(cert_path, key_path)
        return cls(context, fingerprint(cert.public_bytes(serialization.Encoding.DER)))


def client_context() -> ssl.SSLContext:
    """The client's context: TLS 1.3 only, no CA and no host name (the pin replaces both)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def is_fingerprint(value: str) -> bool:
    """Whether ``value`` has the form of a fingerprint (64 lowercase hex digits)."""
    return len(value) == FINGERPRINT_HEX and all(c in "0123456789abcdef" for c in value)


def check_pin(ssl_object, expected: str, where: str) -> None:
    """Raise ConnectionError unless the TLS endpoint behind ``ssl_object`` presented the
    certificate whose fingerprint is ``expected`` (``where`` names it in the message).

    Call after the handshake and before writing anything: a mismatch means whoever answered at
    that address is not the peer that made the offer.
    """
    if ssl_object is None:
        raise ConnectionError(f"{where} is not a TLS connection")
    if ssl_object.version() != "TLSv1.3":
        raise ConnectionError(f"{where} negotiated {ssl_object.version()}, not TLS 1.3")
    der = ssl_object.getpeercert(binary_form=True)
    if not der or not is_fingerprint(expected) or not hmac.compare_digest(fingerprint(der), expected):
        raise ConnectionError(f"{where} presented a certificate other than the one the peer pinned")
