"""Ownership, signatures, key persistence and trust (no network)."""

import dataclasses
import logging

import pytest
from hivemind.dht.validation import DHTRecord

from p2pserve.dht.signing import (
    LoggingSignatureValidator,
    is_trusted,
    load_or_create_key,
    normalize_public_key,
    owner_of_subkey,
    owner_subkey,
    public_key_text,
    trusted_set,
)
from p2pserve.errors import ConfigError


@pytest.fixture(scope="module")
def keys():
    return load_or_create_key(None), load_or_create_key(None)


def test_key_persisted(tmp_path):
    path = str(tmp_path / "sub" / "k.der")
    k1 = load_or_create_key(path)
    k2 = load_or_create_key(path)
    assert public_key_text(k1) == public_key_text(k2)
    assert (tmp_path / "sub" / "k.der").stat().st_mode & 0o777 == 0o600
    (tmp_path / "bad.der").write_bytes(b"nope")
    with pytest.raises(ConfigError):
        load_or_create_key(str(tmp_path / "bad.der"))


def test_owner_subkey_roundtrip(keys):
    a, _ = keys
    assert owner_of_subkey(owner_subkey(a)) == public_key_text(a)
    assert owner_of_subkey(b"plain") is None
    assert owner_of_subkey(12) is None


def _record(key, value=b"\x01"):
    return DHTRecord(key=b"k", subkey=owner_subkey(key), value=value, expiration_time=123.0)


def test_signed_record_validates_and_forgery_is_logged(keys, caplog):
    a, b = keys
    va, vb = LoggingSignatureValidator(a), LoggingSignatureValidator(b)
    rec = _record(a)
    signed = dataclasses.replace(rec, value=va.sign_value(rec))
    assert vb.validate(signed)  # anyone can check a's signature
    # b signs a record that claims a's subkey: a forgery
    forged_value = vb.SIGNATURE_FORMAT.replace(b"_value_", b.sign(vb._serialize_record(rec)))
    forged_value = rec.value + forged_value
    with caplog.at_level(logging.WARNING):
        assert not va.validate(dataclasses.replace(rec, value=forged_value))
    assert "signature does not match" in caplog.text
    # tampered value, same signature
    tampered = dataclasses.replace(signed, value=b"\x02" + signed.value[1:])
    assert not va.validate(tampered)
    # unsigned value under an owned subkey
    assert not va.validate(rec)
    # unprotected records are not this validator's business
    assert va.validate(DHTRecord(b"k", b"free", b"v", 1.0))


def test_trust(keys):
    a, b = keys
    ta = trusted_set([public_key_text(a) + " comment"])
    assert is_trusted(public_key_text(a), ta)
    assert not is_trusted(public_key_text(b), ta)
    assert is_trusted(public_key_text(b), frozenset())  # open swarm
    assert not is_trusted("garbage", ta)
    with pytest.raises(ConfigError):
        normalize_public_key("ssh-ed25519 AAAA")
