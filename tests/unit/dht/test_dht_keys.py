"""Key schema (pure)."""

import pytest

from p2pserve.dht.keys import RecordKind, model_slug, parse_key, record_key
from p2pserve.errors import ConfigError


def test_keys_are_prefixed_and_distinct():
    a = record_key("swarm", "org/llama", RecordKind.PEERS)
    assert a == "swarm/org--llama/peers"
    assert parse_key(a) == ("swarm", "org--llama", RecordKind.PEERS)
    keys = {record_key(s, m, k) for s in ("s1", "s2") for m in ("a", "b") for k in RecordKind}
    assert len(keys) == 2 * 2 * len(RecordKind)


def test_bad_names():
    for bad in ("", "a b", "x" * 200):
        with pytest.raises(ConfigError):
            record_key(bad, "m", "plan")
    with pytest.raises(ConfigError):
        parse_key("a/b")
    with pytest.raises(ConfigError):
        parse_key("a/b/nonsense")
    assert model_slug(" m ") == "m"
