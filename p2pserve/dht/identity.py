"""One key per member: the RSA key that signs a member's DHT records is its libp2p identity.

A libp2p peer id is the multihash of the peer's public key (sha2-256 of the protobuf-encoded
``PublicKey`` for RSA keys, see https://github.com/libp2p/specs/blob/master/peer-ids/peer-ids.md).
Every DHT record names its signer's public key in its subkey (:mod:`p2pserve.dht.signing`), so a
reader derives the signer's peer id from the record alone (:func:`peer_id_of`) and can refuse a
record *about* peer X that X's key did not sign: no registry, no extra round trip.

For that, a member's hivemind node must run with the very key that signs its records. hivemind
reads its identity from a file holding a protobuf ``PrivateKey`` (key type RSA, DER data); this
module reads and writes such files and decides which key a node uses (:func:`node_key`):

* neither ``key_path`` nor ``identity_path``: a fresh ephemeral key;
* one of them: that file's key (created, mode 0600, if missing); ``key_path`` holds plain DER
  (what ``p2pserve coordinator --print-public-key`` reads), ``identity_path`` the libp2p
  protobuf (what ``hivemind`` and ``p2pd`` write);
* both: the same key in two formats. A missing one is written from the other; two existing
  files holding different keys are a :class:`~p2pserve.errors.ConfigError`.

hivemind then gets an identity file: ``identity_path`` itself, or a private 0600 temporary
copy (:func:`identity_file`) that is deleted as soon as the node has started.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import tempfile
from typing import Iterator, Optional

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from google.protobuf.message import DecodeError
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from p2pserve.dht.signing import load_or_create_key, public_key_text, wrap_private_key, write_private_file
from p2pserve.errors import ConfigError

# multihash prefixes: sha2-256 with a 32-byte digest (RSA and other long keys), and "identity"
# (the key itself, for keys of at most 42 bytes such as Ed25519: the 12D3Koo... ids)
_SHA2_256 = b"\x12\x20"
_IDENTITY = 0x00
_MAX_ID_CHARS = 128


@functools.lru_cache(maxsize=4096)
def peer_id_of(public_key_text: str) -> str:
    """The libp2p peer id (base58) of the node whose RSA public key is ``public_key_text``
    (OpenSSH text, a trailing comment allowed). ``ConfigError`` if it is no RSA public key.

    Cached: every reader derives it for every record of every read.
    """
    parts = public_key_text.strip().split()
    if len(parts) < 2 or parts[0] != "ssh-rsa":
        raise ConfigError(f"not an OpenSSH RSA public key: {public_key_text[:40]!r}")
    try:
        key = serialization.load_ssh_public_key(f"{parts[0]} {parts[1]}".encode())
    except (ValueError, UnsupportedAlgorithm) as e:
        raise ConfigError(f"invalid RSA public key {parts[1][:20]}...: {e}") from e
    if not isinstance(key, rsa.RSAPublicKey):
        raise ConfigError("not an RSA public key")
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(_SHA2_256 + hashlib.sha256(encoded).digest()).to_base58()


def looks_like_peer_id(text: object) -> bool:
    """Whether ``text`` parses as a libp2p peer id: base58 of a sha2-256 or identity multihash.

    Used where a record's id field may be either a peer id (which must then be its signer's) or a
    free name an operator chose (``--coordinator-id``).
    """
    if not isinstance(text, str) or not 0 < len(text) <= _MAX_ID_CHARS:
        return False
    try:
        raw = PeerID.from_base58(text).to_bytes()
    except ValueError:
        return False
    if raw[:2] == _SHA2_256:
        return len(raw) == 34
    return len(raw) >= 2 and raw[0] == _IDENTITY and raw[1] == len(raw) - 2


def identity_bytes(key: RSAPrivateKey) -> bytes:
    """The libp2p identity file's content for ``key``: protobuf ``PrivateKey`` (RSA, DER)."""
    return crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=key.to_bytes()).SerializeToString()


def read_identity(path: str) -> RSAPrivateKey:
    """The RSA key in a libp2p identity file (``ConfigError`` if it holds anything else)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read identity {path}: {e}") from e
    try:
        proto = crypto_pb2.PrivateKey.FromString(data)
    except DecodeError as e:
        raise ConfigError(f"{path} is not a libp2p identity (protobuf PrivateKey): {e}") from e
    if proto.key_type != crypto_pb2.RSA:
        raise ConfigError(f"{path} holds a {crypto_pb2.KeyType.Name(proto.key_type)} identity; "
                          "p2pserve signs its records with RSA, so its identity must be an RSA key")
    try:
        return wrap_private_key(serialization.load_der_private_key(proto.data, password=None))
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise ConfigError(f"{path}: the identity's RSA key does not parse: {e}") from e


def write_identity(path: str, key: RSAPrivateKey) -> None:
    """Write ``key`` as a libp2p identity file (mode 0600, atomically)."""
    write_private_file(path, identity_bytes(key))


def node_key(key_path: Optional[str], identity_path: Optional[str]) -> RSAPrivateKey:
    """The one key of a node configured with these paths (see the module docstring); creates
    the files that are named but missing."""
    if identity_path is None:
        return load_or_create_key(key_path)
    if key_path is None or not os.path.exists(key_path):
        key = read_identity(identity_path) if os.path.exists(identity_path) else load_or_create_key(key_path)
        if not os.path.exists(identity_path):
            write_identity(identity_path, key)
        if key_path is not None and not os.path.exists(key_path):
            write_private_file(key_path, key.to_bytes())
        return key
    key = load_or_create_key(key_path)
    if not os.path.exists(identity_path):
        write_identity(identity_path, key)
        return key
    if public_key_text(read_identity(identity_path)) != public_key_text(key):
        raise ConfigError(
            f"key_path {key_path} and identity_path {identity_path} hold different keys; a member has one key "
            "(it signs its records and is its libp2p identity). Give one of them, or delete the identity file "
            "to write it from the key (the peer id then changes; a coordinator's trusted key does not)")
    return key


@contextlib.contextmanager
def identity_file(key: RSAPrivateKey, directory: Optional[str] = None) -> Iterator[str]:
    """A private (0600) temporary libp2p identity file holding ``key``, deleted on exit: for a
    node whose key has no identity file of its own (ephemeral, or ``key_path`` only).

    ``directory`` (default: the system's temporary directory) is where a process killed while
    its node starts leaves the copy behind: for a persistent key, the key file's own directory.
    """
    fd, path = tempfile.mkstemp(prefix=".p2pserve-identity-", dir=directory)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(identity_bytes(key))
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
