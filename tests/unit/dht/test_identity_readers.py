"""The identity, time and allow-list rules as Swarm's readers (over a fake DHT) and the shared
FakeSwarm apply them, and the allow-list's flag and swarm-file entry."""

import argparse
import asyncio
import json

import msgspec
import pytest

from p2pserve.cli.common import add_dht_arguments, dht_config_from_args
from p2pserve.config import DHTConfig
from p2pserve.dht.identity import peer_id_of
from p2pserve.dht.keys import RecordKind, record_key
from p2pserve.dht.records import LinkInfo, LinkStat, PeerInfo, encode_record
from p2pserve.dht.signing import load_or_create_key, owner_subkey, public_key_text
from p2pserve.dht.swarm import Swarm
from p2pserve.errors import ConfigError, RecordRejected
from p2pserve.testing import FakeClock, FakeDHT, FakeSwarm, FakeSwarmStore

Entry = FakeDHT.Entry


class Report(msgspec.Struct, kw_only=True, frozen=True):
    """A record of the new kinds: by its author, ``reporter_id``."""

    model: str
    reporter_id: str
    subject: str
    timestamp: float = 0.0

    def validate(self) -> None:
        if not self.reporter_id:
            raise RecordRejected("reporter_id missing")


@pytest.fixture(scope="module")
def keys():
    return [load_or_create_key(None) for _ in range(3)]


def pid(key) -> str:
    return peer_id_of(public_key_text(key))


def node(keys, i, dht, clock, **cfg):
    return Swarm(DHTConfig(model="m", swarm_id="s", reject_log_interval=0.0, **cfg), dht, keys[i], clock=clock)


def forge(dht, kind, signer, record, expiration):
    """What a hostile member stores under its own (validly signed) subkey."""
    dht.data.setdefault(record_key("s", "m", kind), {})[owner_subkey(signer)] = Entry(encode_record(record), expiration)


def test_a_record_claiming_another_peer_is_rejected_and_the_victims_own_kept(keys, caplog):
    dht, clock = FakeDHT(), FakeClock()
    victim, reader = node(keys, 0, dht, clock), node(keys, 2, dht, clock)
    attacker = keys[1]

    async def go():
        await victim.announce_peer(PeerInfo(model="m", peer_id=victim.peer_id, addrs=["/ip4/10.0.0.1/tcp/1"],
                                            state="joining", kv_free_tokens=1000, timestamp=clock()))
        await victim.announce_links(LinkInfo(model="m", peer_id=victim.peer_id, timestamp=clock(),
                                             links={pid(keys[2]): LinkStat(bandwidth=1e8, rtt=0.001)}))
        # the identity takeover: state draining, no KV, the attacker's address first, links
        # zeroed; the newest timestamp and an expiration far beyond the victim's
        forge(dht, RecordKind.PEERS, attacker, PeerInfo(model="m", peer_id=victim.peer_id, state="draining",
                                                         addrs=["/ip4/6.6.6.6/tcp/1", "/ip4/10.0.0.1/tcp/1"],
                                                         kv_free_tokens=0, timestamp=clock() + 1e6), clock() + 1e6)
        forge(dht, RecordKind.LINKS, attacker, LinkInfo(model="m", peer_id=victim.peer_id, timestamp=clock(),
                                                         links={pid(keys[2]): LinkStat(bandwidth=0.0, rtt=60.0)}),
              clock() + 5)
        peers, links = await reader.get_peers(), await reader.get_links()
        assert set(peers) == {victim.peer_id} and peers[victim.peer_id].record.kv_free_tokens == 1000
        assert peers[victim.peer_id].signer == victim.public_key
        assert links[victim.peer_id].record.links[pid(keys[2])].bandwidth == 1e8

    asyncio.run(go())
    assert "expires" in caplog.text and "beyond its TTL" in caplog.text  # the far-future one: by expiration
    assert f"peer_id ...{victim.peer_id[-12:]} is not the signer's peer id" in caplog.text  # the links one


def test_own_records_beyond_the_time_bounds_are_rejected(keys, caplog):
    dht, clock = FakeDHT(), FakeClock()
    reader = node(keys, 2, dht, clock, peer_refresh=5.0, max_clock_skew=2.0)  # peer TTL 10 s
    liar = keys[1]
    forge(dht, RecordKind.PEERS, liar, PeerInfo(model="m", peer_id=pid(liar), timestamp=clock()), clock() + 12.5)
    assert asyncio.run(reader.get_peers()) == {}
    assert "expires 12 s from now, beyond its TTL 10 s + clock skew 2 s" in caplog.text
    forge(dht, RecordKind.PEERS, liar, PeerInfo(model="m", peer_id=pid(liar), timestamp=clock() + 30), clock() + 10)
    assert asyncio.run(reader.get_peers()) == {}
    assert "timestamp 30 s in the future" in caplog.text
    forge(dht, RecordKind.PEERS, liar, PeerInfo(model="m", peer_id=pid(liar), timestamp=clock() + 1.5), clock() + 11.5)
    assert set(asyncio.run(reader.get_peers())) == {pid(liar)}  # within the skew


def test_one_key_two_entries_resolve_by_expiration_not_timestamp(keys):
    dht, clock = FakeDHT(), FakeClock()
    reader, k = node(keys, 2, dht, clock), keys[1]
    key = record_key("s", "m", RecordKind.PEERS)
    # the same key under two subkeys (an OpenSSH comment makes another subkey)
    newer_stamp = PeerInfo(model="m", peer_id=pid(k), state="draining", timestamp=clock())
    later_expiry = PeerInfo(model="m", peer_id=pid(k), state="joining", timestamp=clock() - 5)
    dht.data[key] = {owner_subkey(k): Entry(encode_record(newer_stamp), clock() + 3),
                     owner_subkey(k)[:-1] + b" other]": Entry(encode_record(later_expiry), clock() + 8)}
    assert asyncio.run(reader.get_peers())[pid(k)].record.state == "joining"


def test_generic_reads_bind_reporter_ids_and_apply_the_allow_list(keys, caplog):
    dht, clock = FakeDHT(), FakeClock()
    a, b = node(keys, 0, dht, clock), node(keys, 1, dht, clock)
    reader = node(keys, 2, dht, clock, allowed_peers=(a.peer_id,))

    async def go():
        await a.announce(RecordKind.REPORTS, Report(model="m", reporter_id=a.peer_id, subject="x"))
        forge(dht, RecordKind.EVIDENCE, keys[1], Report(model="m", reporter_id=a.peer_id, subject="x"), clock() + 5)
        assert [s.record.reporter_id for s in await reader.read(RecordKind.REPORTS, Report)] == [a.peer_id]
        assert await a.read(RecordKind.EVIDENCE, Report) == []  # b's key, a's reporter_id
        await b.announce(RecordKind.REPORTS, Report(model="m", reporter_id=b.peer_id, subject="x"))
        await b.announce_peer(PeerInfo(model="m", peer_id=b.peer_id))
        assert len(await a.read(RecordKind.REPORTS, Report)) == 2  # an open swarm reads both
        assert [s.record.reporter_id for s in await reader.read(RecordKind.REPORTS, Report)] == [a.peer_id]
        assert await reader.get_peers() == {}

    asyncio.run(go())
    assert "reporter_id" in caplog.text and "is not in allowed_peers" in caplog.text


def test_writers_refuse_what_readers_would_reject(keys):
    dht, clock = FakeDHT(), FakeClock()
    a = node(keys, 0, dht, clock, evidence_ttl=100.0)

    async def go():
        with pytest.raises(ConfigError, match="peer_id"):
            await a.announce_peer(PeerInfo(model="m", peer_id=pid(keys[1])))
        with pytest.raises(ConfigError, match="reporter_id"):
            await a.announce(RecordKind.REPORTS, Report(model="m", reporter_id="someone", subject="x"))
        # a longer TTL than the kind's is cut to it, so that readers accept the record
        await a.announce(RecordKind.EVIDENCE, Report(model="m", reporter_id=a.peer_id, subject="x"), ttl=1e6)
        [entry] = dht.data[record_key("s", "m", RecordKind.EVIDENCE)].values()
        assert entry.expiration_time == clock() + 100.0
        assert len(await a.read(RecordKind.EVIDENCE, Report)) == 1

    asyncio.run(go())
    with pytest.raises(ConfigError, match="allowed_peers"):
        node(keys, 0, dht, clock, allowed_peers=("peer-1",))


def test_the_fake_swarm_applies_the_same_identity_rules():
    store = FakeSwarmStore()
    a, reader = FakeSwarm(store, "a"), FakeSwarm(store, "r", DHTConfig(model="m", allowed_peers=("a",)))
    with pytest.raises(ConfigError):
        asyncio.run(a.announce_peer(PeerInfo(model="m", peer_id="b")))
    asyncio.run(a.announce_peer(PeerInfo(model="m", peer_id="a")))
    store.put(RecordKind.PEERS, "key-x", PeerInfo(model="m", peer_id="a", state="draining"))  # x claims a
    store.put(RecordKind.PEERS, "key-c", PeerInfo(model="m", peer_id="c"))  # not on the allow-list
    peers = asyncio.run(reader.get_peers())
    assert set(peers) == {"a"} and peers["a"].record.state == "joining"
    assert {s for _, s, r in reader.rejected if "allowed_peers" in r} == {"key-x", "key-c"}
    open_view = FakeSwarm(store, "open")
    assert set(asyncio.run(open_view.get_peers())) == {"a", "c"}
    assert [(s, r.split()[0]) for _, s, r in open_view.rejected] == [("key-x", "peer_id")]


def test_allowed_peers_from_the_swarm_file_and_the_flag(keys, tmp_path):
    ids = [pid(k) for k in keys]
    (tmp_path / "s.json").write_text(json.dumps({"model": "m", "allowed_peers": ids[:2]}))
    p = argparse.ArgumentParser()
    add_dht_arguments(p)
    cfg, _ = dht_config_from_args(p.parse_args(["--config", str(tmp_path / "s.json")]))
    assert cfg.allowed_peers == tuple(ids[:2])
    cfg, _ = dht_config_from_args(p.parse_args(["--config", str(tmp_path / "s.json"), "--allowed-peers", ids[2]]))
    assert cfg.allowed_peers == (ids[2],)
    cfg, _ = dht_config_from_args(p.parse_args(["--config", str(tmp_path / "s.json"), "--allowed-peers"]))
    assert cfg.allowed_peers == ()  # given empty: an open swarm, whatever the file says
