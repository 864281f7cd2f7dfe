"""One key per member: peer ids derived from signing keys, identity files, which key a node uses,
and the pure acceptance rules (identity binding, time bounds, allow-list)."""

import math
import os
import stat

import msgspec
import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2

from p2pserve.dht.acceptance import (
    allowed_set,
    expiration_reason,
    identity_reason,
    membership_reason,
    timestamp_reason,
)
from p2pserve.dht.identity import (
    identity_bytes,
    identity_file,
    looks_like_peer_id,
    node_key,
    peer_id_of,
    read_identity,
    write_identity,
)
from p2pserve.dht.records import CoordinatorCandidate, Flow, LinkInfo, LinkStat, PeerInfo, Plan
from p2pserve.dht.signing import load_or_create_key, public_key_text
from p2pserve.errors import ConfigError


@pytest.fixture(scope="module")
def keys():
    return [load_or_create_key(None) for _ in range(2)]


def ed25519_peer_id() -> str:
    """A peer id of the other shape libp2p uses (identity multihash of an Ed25519 key: 12D3Koo...)."""
    public = crypto_pb2.PublicKey(key_type=crypto_pb2.Ed25519, data=bytes(range(32))).SerializeToString()
    return PeerID(bytes([0, len(public)]) + public).to_base58()


def test_peer_id_of_a_public_key_is_hivemind_s_peer_id_of_the_identity(keys, tmp_path):
    for key in keys:
        assert peer_id_of(public_key_text(key)) == PeerID.from_identity(identity_bytes(key)).to_base58()
        # a trailing comment in the OpenSSH text changes nothing
        assert peer_id_of(public_key_text(key) + " me@host") == peer_id_of(public_key_text(key))
    # and for an identity file written by hivemind itself
    path = str(tmp_path / "hivemind.id")
    P2P.generate_identity(path)
    with open(path, "rb") as f:
        expected = PeerID.from_identity(f.read()).to_base58()
    assert peer_id_of(public_key_text(read_identity(path))) == expected
    assert peer_id_of(public_key_text(keys[0])) != peer_id_of(public_key_text(keys[1]))
    for bad in ("", "ssh-rsa", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA", "ssh-rsa AAAA"):
        with pytest.raises(ConfigError):
            peer_id_of(bad)


def test_looks_like_peer_id(keys):
    assert looks_like_peer_id(peer_id_of(public_key_text(keys[0])))
    assert looks_like_peer_id(ed25519_peer_id()) and ed25519_peer_id().startswith("12D3Koo")
    for name in ("coord-1", "c1", "", "0OIl", "Qm", "x" * 200, None, 42):
        assert not looks_like_peer_id(name)


def test_identity_files_round_trip_privately(keys, tmp_path):
    path = str(tmp_path / "sub" / "node.id")
    write_identity(path, keys[0])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert public_key_text(read_identity(path)) == public_key_text(keys[0])
    (tmp_path / "garbage.id").write_bytes(b"\xff\x00not a protobuf")
    ed = tmp_path / "ed.id"
    ed.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=bytes(64)).SerializeToString())
    for bad in ("garbage.id", "ed.id", "missing.id"):
        with pytest.raises(ConfigError):
            read_identity(str(tmp_path / bad))
    with identity_file(keys[1]) as temp:
        assert stat.S_IMODE(os.stat(temp).st_mode) == 0o600
        assert public_key_text(read_identity(temp)) == public_key_text(keys[1])
    assert not os.path.exists(temp)
    with identity_file(keys[1], str(tmp_path)) as temp:  # next to a persistent key
        assert os.path.dirname(temp) == str(tmp_path)
    assert not os.path.exists(temp)


def test_node_key_one_key_in_two_formats(keys, tmp_path):
    def pub(k):
        return public_key_text(k)

    assert pub(node_key(None, None)) != pub(node_key(None, None))  # ephemeral
    # only one path: that file's key, created if missing
    k1 = node_key(str(tmp_path / "a.key"), None)
    assert pub(node_key(str(tmp_path / "a.key"), None)) == pub(k1)
    k2 = node_key(None, str(tmp_path / "b.id"))
    assert pub(node_key(None, str(tmp_path / "b.id"))) == pub(k2)
    # both, neither existing: one key written in both formats
    k3 = node_key(str(tmp_path / "c.key"), str(tmp_path / "c.id"))
    assert pub(load_or_create_key(str(tmp_path / "c.key"))) == pub(read_identity(str(tmp_path / "c.id"))) == pub(k3)
    # both, one existing: the other is written from it (either way round)
    assert pub(node_key(str(tmp_path / "a.key"), str(tmp_path / "a.id"))) == pub(k1)
    assert pub(read_identity(str(tmp_path / "a.id"))) == pub(k1)
    assert pub(node_key(str(tmp_path / "b.key"), str(tmp_path / "b.id"))) == pub(k2)
    assert pub(load_or_create_key(str(tmp_path / "b.key"))) == pub(k2)
    # both existing with different keys: refused
    with pytest.raises(ConfigError, match="different keys"):
        node_key(str(tmp_path / "a.key"), str(tmp_path / "b.id"))


class Report(msgspec.Struct, kw_only=True, frozen=True):
    """A record of a kind other engineers define: identified by its author's ``reporter_id``."""

    reporter_id: str
    created_at: float = 0.0
    samples: list[LinkStat] = []


def test_identity_binding(keys):
    me, other = peer_id_of(public_key_text(keys[0])), peer_id_of(public_key_text(keys[1]))
    assert identity_reason(PeerInfo(model="m", peer_id=me), me) is None
    assert "peer_id" in identity_reason(PeerInfo(model="m", peer_id=other), me)
    assert "peer_id" in identity_reason(LinkInfo(model="m", peer_id="made-up"), me)
    assert identity_reason(Report(reporter_id=me), me) is None
    assert "reporter_id" in identity_reason(Report(reporter_id=other), me)
    # coordinator and leader ids: a free name is fine, another's peer id is not
    cand = CoordinatorCandidate(model="m", coordinator_id="coord-1", start_time=1.0, public_key="k")
    assert identity_reason(cand, me) is None
    assert identity_reason(msgspec.structs.replace(cand, coordinator_id=me), me) is None
    assert "coordinator_id" in identity_reason(msgspec.structs.replace(cand, coordinator_id=other), me)
    assert "coordinator_id" in identity_reason(msgspec.structs.replace(cand, coordinator_id=ed25519_peer_id()), me)
    plan = Plan(model="m", epoch=1, leader_id=other, num_layers=2)
    assert "leader_id" in identity_reason(plan, me)
    assert identity_reason(msgspec.structs.replace(plan, leader_id="c1"), me) is None


def test_time_bounds():
    now, skew = 1000.0, 2.0
    assert expiration_reason(now + 10 + skew, now, 10.0, skew) is None
    assert "beyond its TTL" in expiration_reason(now + 10 + skew + 0.5, now, 10.0, skew)
    assert expiration_reason(math.nan, now, 10.0, skew) is not None
    assert expiration_reason(math.inf, now, 10.0, skew) is not None
    assert timestamp_reason(PeerInfo(model="m", peer_id="p", timestamp=now + skew), now, skew) is None
    assert "timestamp" in timestamp_reason(PeerInfo(model="m", peer_id="p", timestamp=now + 1e6), now, skew)
    assert "start_time" in timestamp_reason(
        CoordinatorCandidate(model="m", coordinator_id="c", start_time=now + 60, public_key="k"), now, skew)
    assert "created_at" in timestamp_reason(Plan(model="m", epoch=1, leader_id="c", num_layers=2,
                                                 created_at=now + 60), now, skew)
    # times inside the structs a record holds count too: a link reading from the future
    links = {"q": LinkStat(bandwidth=1.0, rtt=0.0, measured_at=now - 1), "r": LinkStat(bandwidth=1.0, rtt=0.0,
                                                                                       measured_at=now + 60)}
    assert "measured_at" in timestamp_reason(LinkInfo(model="m", peer_id="p", links=links, timestamp=now), now, skew)
    assert "measured_at" in timestamp_reason(Report(reporter_id="p", samples=[links["r"]]), now, skew)
    # a plan's many flows carry no time and are not walked
    plan = Plan(model="m", epoch=1, leader_id="c", num_layers=2, spans={"a": (0, 2)},
                flows=[Flow("source", "a", 1.0)] * 1000, created_at=now)
    assert timestamp_reason(plan, now, skew) is None
    assert timestamp_reason(b"not a struct", now, skew) is None


def test_allow_list(keys):
    me, other = peer_id_of(public_key_text(keys[0])), peer_id_of(public_key_text(keys[1]))
    allowed = allowed_set([me, f" {ed25519_peer_id()} "])
    assert ed25519_peer_id() in allowed
    for kind in ("peers", "links", "reports", "evidence"):
        assert membership_reason(kind, me, allowed) is None
        assert "allowed_peers" in membership_reason(kind, other, allowed)
        assert membership_reason(kind, other, frozenset()) is None  # open swarm
    for kind in ("coordinators", "plan"):  # those are gated by trusted_coordinators instead
        assert membership_reason(kind, other, allowed) is None
    with pytest.raises(ConfigError, match="not a libp2p peer id"):
        allowed_set([me, "peer-1"])
