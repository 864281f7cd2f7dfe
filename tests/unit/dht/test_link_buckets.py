"""Link records spread over bucket keys by a hash of the peer id (pure keys; Swarm's reader over
the shared FakeDHT)."""

import asyncio

import pytest

from p2pserve.config import DHTConfig
from p2pserve.dht.identity import peer_id_of
from p2pserve.dht.acceptance import bucket_reason
from p2pserve.dht.keys import LINK_BUCKETS, RecordKind, link_bucket, link_keys, read_keys, record_key, write_key
from p2pserve.dht.records import LinkInfo, LinkStat, encode_record
from p2pserve.dht.signing import load_or_create_key, owner_subkey, public_key_text
from p2pserve.dht.swarm import Swarm
from p2pserve.testing import FakeClock, FakeDHT


@pytest.fixture(scope="module")
def keys():
    return [load_or_create_key(None) for _ in range(6)]


def node(key, dht, clock):
    return Swarm(DHTConfig(model="m", swarm_id="s", reject_log_interval=0.0), dht, key, clock=clock)


def links_of(sw, clock, other="12D3KooWother"):
    return LinkInfo(model="m", peer_id=sw.peer_id, timestamp=clock(), links={other: LinkStat(bandwidth=1e8, rtt=0.01)})


def test_buckets_are_stable_spread_and_under_the_links_key():
    ids = [f"12D3KooW{i:044d}" for i in range(2000)]
    counts = [0] * LINK_BUCKETS
    for pid in ids:
        assert link_bucket(pid) == link_bucket(pid)
        counts[link_bucket(pid)] += 1
    # a hash: every bucket gets its share, none more than twice it
    assert min(counts) > 0 and max(counts) < 2 * len(ids) / LINK_BUCKETS
    ks = link_keys("s", "org/m")
    assert len(set(ks)) == LINK_BUCKETS and all(k.startswith(record_key("s", "org/m", RecordKind.LINKS) + "/")
                                                 for k in ks)


def test_each_peer_stores_its_links_in_its_bucket_and_a_reader_gets_them_all(keys):
    dht, clock = FakeDHT(), FakeClock()
    peers = [node(k, dht, clock) for k in keys]

    async def go():
        for sw in peers:
            assert await sw.announce_links(links_of(sw, clock))
        return await peers[0].get_links()

    got = asyncio.run(go())
    assert set(got) == {sw.peer_id for sw in peers}
    ks = link_keys("s", "m")
    for sw in peers:
        assert owner_subkey(sw._key) in dht.data[ks[link_bucket(sw.peer_id)]]
    assert record_key("s", "m", RecordKind.LINKS) not in dht.data


def test_a_withdrawn_link_record_is_seen_in_its_bucket(keys):
    dht, clock = FakeDHT(), FakeClock()
    a, b = node(keys[0], dht, clock), node(keys[1], dht, clock)

    async def go():
        await a.announce_links(links_of(a, clock))
        await a.withdraw(RecordKind.LINKS)
        return await b.get_links()

    assert asyncio.run(go()) == {} and b.withdrawn[RecordKind.LINKS] == {a.public_key}


def test_records_under_the_links_key_are_still_read_and_a_wrong_bucket_is_refused(keys, caplog):
    dht, clock = FakeDHT(), FakeClock()
    reader, old, stray = (node(k, dht, clock) for k in keys[:3])
    # a peer storing under the kind's own key (as before buckets) is still read
    dht.data.setdefault(record_key("s", "m", RecordKind.LINKS), {})[owner_subkey(old._key)] = FakeDHT.Entry(
        encode_record(links_of(old, clock)), clock() + 60)
    # a record in a bucket its peer id does not hash to is dropped, with the reason
    wrong = (link_bucket(stray.peer_id) + 1) % LINK_BUCKETS
    dht.data.setdefault(link_keys("s", "m")[wrong], {})[owner_subkey(stray._key)] = FakeDHT.Entry(
        encode_record(links_of(stray, clock)), clock() + 60)
    got = asyncio.run(reader.get_links())
    assert set(got) == {old.peer_id}
    assert "not its signer's" in caplog.text and peer_id_of(public_key_text(stray._key)) not in got


def test_the_bucket_rule():
    pid = "12D3KooWsomeone"
    assert bucket_reason(pid, None) is None and bucket_reason(pid, link_bucket(pid)) is None
    assert "not its signer's" in bucket_reason(pid, (link_bucket(pid) + 1) % LINK_BUCKETS)
    assert read_keys("s", "m", RecordKind.PEERS) == [(record_key("s", "m", RecordKind.PEERS), None)]
    links = read_keys("s", "m", RecordKind.LINKS)
    assert links[0] == (record_key("s", "m", RecordKind.LINKS), None) and [b for _, b in links[1:]] == list(
        range(LINK_BUCKETS))
    assert write_key("s", "m", RecordKind.LINKS, pid) == link_keys("s", "m")[link_bucket(pid)]
    assert write_key("s", "m", RecordKind.PEERS, pid) == record_key("s", "m", RecordKind.PEERS)
