"""Bound identities with real hivemind nodes on loopback.

A bootstrap node, a victim, an attacker and two readers (one open, one with an allow-list),
each a real DHT node with its own key. The attacker replays an identity takeover:
validly signed records (its own key, its own subkey, so honest replicas store them) claiming
the victim's peer id with the state ``draining``, no KV, its own address first, the victim's
links zeroed, a far-future timestamp and a far-future DHT expiration. Readers must keep the
victim's own records and log why they dropped the attacker's.

Records live long here (refreshes of 30 s) so that nothing needs refreshing during the tests.
"""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
from hivemind.p2p import PeerID

from p2pserve.clock import wall
from p2pserve.config import BootstrapConfig, DHTConfig
from p2pserve.dht.identity import peer_id_of, write_identity
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.node import BootstrapNode
from p2pserve.dht.records import LinkInfo, LinkStat, PeerInfo, encode_record
from p2pserve.dht.signing import load_or_create_key, public_key_text
from p2pserve.dht.swarm import Swarm
from p2pserve.errors import ConfigError
from tests.support import wait_for

pytestmark = pytest.mark.integration

MODEL = "tiny-identity"
TIMING = dict(peer_refresh=30.0, link_refresh=30.0, max_clock_skew=2.0)  # TTLs 60 s
LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)

_LOOP: asyncio.AbstractEventLoop | None = None


def run(coro):
    """Run a coroutine on this module's own loop."""
    global _LOOP
    if _LOOP is None or _LOOP.is_closed():
        _LOOP = asyncio.new_event_loop()
    return _LOOP.run_until_complete(coro)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """Bootstrap, victim (persistent key in both formats), attacker, open reader, members-only reader."""
    tmp = tmp_path_factory.mktemp("identity")
    started: dict[str, object] = {}
    try:
        boot = started["boot"] = BootstrapNode.create(BootstrapConfig(host_maddrs=LOOPBACK))
        base = DHTConfig(model=MODEL, swarm_id="id-test", initial_peers=tuple(boot.visible_maddrs()),
                         host_maddrs=LOOPBACK, reject_log_interval=0.0, **TIMING)
        victim = started["victim"] = Swarm.create(base.replace(key_path=str(tmp / "victim.key"),
                                                               identity_path=str(tmp / "victim.id")))
        started["attacker"] = Swarm.create(base.replace(key_path=str(tmp / "attacker.key")))
        started["reader"] = Swarm.create(base)
        started["members"] = Swarm.create(base.replace(allowed_peers=(victim.peer_id,), client_mode=True))
        yield dict(started, tmp=tmp, base=base)
    finally:
        for n in started.values():
            n.shutdown()
        if _LOOP is not None and not _LOOP.is_closed():
            _LOOP.close()


def test_a_node_runs_as_its_signing_key(nodes):
    """The peer id a reader derives from a signer's key is the id the signer's node runs as."""
    for name in ("victim", "attacker", "reader", "members"):
        sw = nodes[name]
        assert sw.dht.peer_id.to_base58() == sw.peer_id == peer_id_of(sw.public_key), name
    with open(nodes["tmp"] / "victim.id", "rb") as f:
        assert PeerID.from_identity(f.read()).to_base58() == nodes["victim"].peer_id
    assert public_key_text(load_or_create_key(str(nodes["tmp"] / "victim.key"))) == nodes["victim"].public_key
    # the attacker's key_path-only identity reached hivemind through a temporary copy, gone now
    assert public_key_text(load_or_create_key(str(nodes["tmp"] / "attacker.key"))) == nodes["attacker"].public_key
    assert sorted(os.listdir(nodes["tmp"])) == ["attacker.key", "victim.id", "victim.key"]
    # a key file and an identity file holding different keys: refused before anything starts
    other = str(nodes["tmp"] / "other.id")
    write_identity(other, load_or_create_key(None))
    with pytest.raises(ConfigError, match="different keys"):
        Swarm.create(nodes["base"].replace(key_path=str(nodes["tmp"] / "victim.key"), identity_path=other))


def attacker_store(sw: Swarm, kind: RecordKind, record, expiration: float) -> None:
    """Store ``record`` under the attacker's own subkey, signed by its DHT validator, with the
    expiration it chooses (what a modified member can do; no honest code path does)."""
    async def store():
        fut = sw.dht.store(sw._keys[kind], encode_record(record), expiration_time=expiration, subkey=sw._subkey,
                           return_future=True)
        return await asyncio.wait_for(asyncio.wrap_future(fut), 30.0)

    assert run(store()), "honest replicas refused a validly signed record"


def test_identity_takeover_records_are_rejected(nodes, caplog):
    victim, attacker, reader = nodes["victim"], nodes["attacker"], nodes["reader"]
    now = wall()
    own = PeerInfo(model=MODEL, peer_id=victim.peer_id, addrs=victim.visible_maddrs(), state="joining",
                   kv_free_tokens=50_000, timestamp=now)
    assert run(victim.announce_peer(own))
    assert run(victim.announce_links(LinkInfo(model=MODEL, peer_id=victim.peer_id, timestamp=now,
                                              links={reader.peer_id: LinkStat(bandwidth=1e8, rtt=0.001)})))
    # the attacker's own record with a far-future timestamp: beyond the clock skew
    attacker_store(attacker, RecordKind.PEERS, PeerInfo(model=MODEL, peer_id=attacker.peer_id, timestamp=now + 1e6),
                   now + 30)
    # then the takeover: the victim's id, draining, no KV, its address first, and far-future
    # timestamp and expiration (the latter replaces its previous entry on every replica)
    takeover = PeerInfo(model=MODEL, peer_id=victim.peer_id, addrs=attacker.visible_maddrs() + own.addrs,
                        state="draining", kv_free_tokens=0, timestamp=now + 1e6)
    links = LinkInfo(model=MODEL, peer_id=victim.peer_id, timestamp=now + 1e6,
                     links={reader.peer_id: LinkStat(bandwidth=0.0, rtt=60.0)})
    with caplog.at_level(logging.WARNING, logger="p2pserve.dht.swarm"):
        wait_for(lambda: run(reader.get_peers()) is not None and "timestamp 1000000 s in the future"
                             in caplog.text, "a reader to drop the attacker's future timestamp", timeout=60.0)
        assert attacker.peer_id not in run(reader.get_peers())
        attacker_store(attacker, RecordKind.PEERS, takeover, now + 1e6)
        attacker_store(attacker, RecordKind.LINKS, links, now + 30)  # a credible expiration: the key decides
        wait_for(lambda: _reads_keep_the_victim(reader, victim, own) and "beyond its TTL 60 s"
                             in caplog.text and "is not the signer's peer id" in caplog.text,
                             "readers to drop the takeover with their reasons", timeout=60.0)
    for _ in range(3):  # and every later read keeps the victim's own records
        assert _reads_keep_the_victim(reader, victim, own)


def _reads_keep_the_victim(reader: Swarm, victim: Swarm, own: PeerInfo) -> bool:
    peers, links = run(reader.get_peers()), run(reader.get_links())
    got = peers.get(victim.peer_id)
    assert got is None or (got.record == own and got.signer == victim.public_key)
    link = links.get(victim.peer_id)
    assert link is None or link.record.links[reader.peer_id].bandwidth == 1e8
    return got is not None and link is not None


def test_the_allow_list_admits_members_only(nodes, caplog):
    victim, reader, members = nodes["victim"], nodes["reader"], nodes["members"]
    assert run(victim.announce_peer(PeerInfo(model=MODEL, peer_id=victim.peer_id, timestamp=wall())))
    assert run(reader.announce_peer(PeerInfo(model=MODEL, peer_id=reader.peer_id, timestamp=wall())))
    with caplog.at_level(logging.WARNING, logger="p2pserve.dht.swarm"):
        wait_for(lambda: {victim.peer_id, reader.peer_id} <= set(run(reader.get_peers())),
                             "an open reader to see both peers", timeout=60.0)
        assert set(run(members.get_peers())) == {victim.peer_id}
    assert f"peer ...{reader.peer_id[-12:]} is not in allowed_peers" in caplog.text
