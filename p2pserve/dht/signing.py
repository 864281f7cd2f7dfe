"""Record ownership and signatures.

Every record is stored under a DHT subkey that *names its owner*: hivemind's
``RSASignatureValidator`` convention ``b"[owner:<OpenSSH public key>]"``. Any DHT node holding
the validator refuses to store, and refuses to return, a value under such a subkey unless it
carries a valid signature by that key over (key, subkey, value, expiration). So only the
holder of a private key can write or refresh "its" entry, and a reader learns the signer's
public key from the subkey.

The signing key is also the node's libp2p identity (:mod:`p2pserve.dht.identity`), so the
signer's peer id follows from the key in the subkey. On top of the signature, readers check (in
:mod:`p2pserve.dht.swarm`, rules in :mod:`p2pserve.dht.acceptance`) that:

* a record about a peer (``peer_id``, ``reporter_id``) was signed by that peer's own key;
* its DHT expiration and timestamps are within its TTL and the tolerated clock skew;
* with an allow-list, a member record comes from a listed peer id;
* a ``CoordinatorCandidate``'s ``public_key`` field equals its signer's key;
* a ``Plan`` was signed by a key listed in ``trusted_coordinators`` (an empty list means an
  open swarm: any signer is accepted).

Rejections are logged with a reason (at WARNING, once per distinct reason) and never raise.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tempfile
from typing import Iterable, Optional

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from p2pserve.errors import ConfigError

logger = logging.getLogger(__name__)

_OWNER_RE = re.compile(rb"\[owner:(.+?)\]")


def load_or_create_key(path: Optional[str]) -> RSAPrivateKey:
    """Load the RSA private key at ``path`` (DER), creating it (mode 0600) if missing.

    ``None`` gives a fresh ephemeral key: fine for tests and throwaway peers, but a coordinator
    listed in ``trusted_coordinators`` needs a persistent one. The same key is the node's libp2p
    identity (:mod:`p2pserve.dht.identity`), so a persistent key also fixes the peer id.
    """
    if path is None:
        return RSAPrivateKey()
    if os.path.exists(path):
        with open(path, "rb") as f:
            data = f.read()
        try:
            return wrap_private_key(serialization.load_der_private_key(data, password=None))
        except ValueError as e:
            raise ConfigError(f"{path} is not a DER RSA private key: {e}") from e
    key = RSAPrivateKey()
    write_private_file(path, key.to_bytes())
    return key


def wrap_private_key(inner: object) -> RSAPrivateKey:
    """hivemind's ``RSAPrivateKey`` around a ``cryptography`` RSA private key (``ValueError`` for
    any other kind of key)."""
    if not isinstance(inner, rsa.RSAPrivateKey):
        raise ValueError(f"expected an RSA private key, got {type(inner).__name__}")
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = inner  # RSAPrivateKey has no public loader; this mirrors its __setstate__
    return key


def write_private_file(path: str, data: bytes) -> None:
    """Write secret ``data`` to ``path`` with mode 0600, atomically: a crash never leaves a
    truncated key behind, and the file is never readable by others, not even for a moment."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".key-")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def public_key_text(key: RSAPrivateKey | RSAPublicKey) -> str:
    """The OpenSSH text of a key's public half (what goes into ``trusted_coordinators``)."""
    if isinstance(key, RSAPrivateKey):
        key = key.get_public_key()
    return key.to_bytes().decode()


def normalize_public_key(text: str) -> str:
    """Canonical form of an OpenSSH public key string: ``"ssh-rsa <base64>"`` (comment dropped)."""
    parts = text.strip().split()
    if len(parts) < 2 or parts[0] != "ssh-rsa":
        raise ConfigError(f"not an OpenSSH RSA public key: {text[:40]!r}...")
    try:
        RSAPublicKey.from_bytes(f"{parts[0]} {parts[1]}".encode())
    except ValueError as e:
        raise ConfigError(f"invalid RSA public key {parts[1][:20]}...: {e}") from e
    return f"{parts[0]} {parts[1]}"


def owner_subkey(key: RSAPrivateKey) -> bytes:
    """The subkey under which this key's owner stores its records."""
    return RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", key.get_public_key().to_bytes())


def owner_of_subkey(subkey: object) -> Optional[str]:
    """The public key text named by a subkey, or ``None`` if the subkey names no owner."""
    if isinstance(subkey, str):
        subkey = subkey.encode()
    if not isinstance(subkey, (bytes, bytearray)):
        return None
    found = _OWNER_RE.findall(bytes(subkey))
    if len(found) != 1:
        return None
    try:
        return found[0].decode()
    except UnicodeDecodeError:
        return None


class LoggingSignatureValidator(RSASignatureValidator):
    """hivemind's RSA validator, plus a WARNING with the reason when a record is refused.

    The parent logs at DEBUG, which would hide forged records from operators. This runs inside
    the DHT process on every store and every get response.
    """

    def __init__(self, private_key: Optional[RSAPrivateKey] = None):
        super().__init__(private_key)
        # (subkey, reason) pairs already logged: a forger refreshing every second is one line
        self._seen: set[tuple[bytes, str]] = set()

    def validate(self, record: DHTRecord) -> bool:
        """Accept unprotected records; for owned ones, require exactly one valid signature."""
        public_keys = self._PUBLIC_KEY_RE.findall(record.key)
        if record.subkey is not None:
            public_keys += self._PUBLIC_KEY_RE.findall(record.subkey)
        if not public_keys:
            return True
        if len(set(public_keys)) > 1:
            return self._refuse(record, "key and subkey name different owners")
        try:
            public_key = RSAPublicKey.from_bytes(public_keys[0])
        except (ValueError, TypeError, UnsupportedAlgorithm):
            # an unknown key type ("[owner:ssh-foo AAAA]") raised UnsupportedAlgorithm, which is no
            # ValueError: the validator raised instead of refusing the record
            return self._refuse(record, "owner public key does not parse")
        signatures = self._SIGNATURE_RE.findall(record.value)
        if len(signatures) != 1:
            return self._refuse(record, f"{len(signatures)} signatures, expected exactly 1")
        stripped = dataclasses.replace(record, value=self.strip_value(record))
        if not public_key.verify(self._serialize_record(stripped), signatures[0]):
            return self._refuse(record, "signature does not match the owner's public key")
        return True

    def _refuse(self, record: DHTRecord, reason: str) -> bool:
        owner = _OWNER_RE.search(record.subkey or b"")
        who = owner.group(1)[-16:].decode(errors="replace") if owner else "?"
        if (record.subkey or b"", reason) not in self._seen:
            if len(self._seen) > 10_000:
                self._seen.clear()
            self._seen.add((record.subkey or b"", reason))
            logger.warning(f"dropped DHT record from owner ...{who}: {reason}")
        return False


def is_trusted(signer: str, trusted: frozenset[str]) -> bool:
    """Whether a plan signed by ``signer`` may be followed (empty ``trusted`` = open swarm)."""
    if not trusted:
        return True
    try:
        return normalize_public_key(signer) in trusted
    except ConfigError:
        return False


def trusted_set(keys: Iterable[str]) -> frozenset[str]:
    """Normalize a configured list of coordinator public keys (``ConfigError`` on a bad one)."""
    return frozenset(normalize_public_key(k) for k in keys)
