"""Swarm's reader side against a fake DHT: trust, tombstones, rejections, keep-last plan, config."""

import asyncio
import json
from concurrent.futures import Future

import pytest
from hivemind.utils import ValueWithExpiration

from p2pserve.cli.common import add_dht_arguments, dht_config_from_args
from p2pserve.dht.config import DHTConfig
from p2pserve.dht.keys import RecordKind, record_key
from p2pserve.dht.records import CoordinatorCandidate, PeerInfo, Plan, encode_record
from p2pserve.dht.signing import load_or_create_key, owner_subkey, public_key_text
from p2pserve.dht.swarm import Swarm
from p2pserve.errors import ConfigError


class FakeDHT:
    def __init__(self):
        self.data = {}

    def get(self, key, latest=False, return_future=False):
        f = Future()
        entries = self.data.get(key)
        f.set_result(None if not entries else ValueWithExpiration(dict(entries), max(v.expiration_time for v in entries.values())))
        return f

    def store(self, key, value, expiration_time, subkey=None, return_future=False):
        self.data.setdefault(key, {})[subkey] = ValueWithExpiration(value, expiration_time)
        f = Future()
        f.set_result(True)
        return f


@pytest.fixture(scope="module")
def keys():
    return [load_or_create_key(None) for _ in range(3)]


class Clock:
    t = 1000.0

    def __call__(self):
        return self.t


def make(keys, i, dht, clock, trusted=()):
    cfg = DHTConfig(model="m", swarm_id="s", trusted_coordinators=tuple(public_key_text(keys[j]) for j in trusted),
                    plan_refresh=5.0, max_clock_skew=0.0, reject_log_interval=0.0)
    return Swarm(cfg, dht, keys[i], clock=clock)


def test_reader_filters(keys, caplog):
    dht, clock = FakeDHT(), Clock()
    a, b = make(keys, 0, dht, clock), make(keys, 1, dht, clock)

    async def go():
        await a.announce_peer(PeerInfo(model="m", peer_id="pa"))
        await b.announce_peer(PeerInfo(model="m", peer_id="pb"))
        assert set(await a.get_peers()) == {"pa", "pb"}
        # an absurd record written around local validation, and one for another model
        key = record_key("s", "m", RecordKind.PEERS)
        bad = PeerInfo(model="m", peer_id="px", max_layers=1, throughput_decode=[1e12])
        dht.data[key][owner_subkey(keys[2])] = ValueWithExpiration(encode_record(bad), 2000.0)
        dht.data[key][b"no-owner"] = ValueWithExpiration(encode_record(PeerInfo(model="m", peer_id="py")), 2000.0)
        assert set(await a.get_peers()) == {"pa", "pb"}
        assert "throughput_decode[1]" in caplog.text and "no owner" in caplog.text
        # withdraw: tombstone, reported as withdrawn
        await b.withdraw_all()
        assert set(await a.get_peers()) == {"pa"}
        assert public_key_text(keys[1]) in a.withdrawn[RecordKind.PEERS]
        # expiry
        clock.t += 100
        assert await a.get_peers() == {}

    asyncio.run(go())


def test_candidates_must_carry_their_signers_key(keys):
    dht, clock = FakeDHT(), Clock()
    a = make(keys, 0, dht, clock)

    async def go():
        with pytest.raises(ConfigError):
            await a.announce_candidate(CoordinatorCandidate(model="m", coordinator_id="x", start_time=1.0,
                                                            public_key=public_key_text(keys[1])))
        key = record_key("s", "m", RecordKind.COORDINATORS)
        lie = CoordinatorCandidate(model="m", coordinator_id="liar", start_time=1.0, public_key=public_key_text(keys[1]))
        dht.data[key] = {owner_subkey(keys[2]): ValueWithExpiration(encode_record(lie), 2000.0)}
        assert await a.get_candidates() == []

    asyncio.run(go())


def test_trusted_plans_and_keep_last(keys):
    dht, clock = FakeDHT(), Clock()
    c1, rogue = make(keys, 0, dht, clock, trusted=(0,)), make(keys, 1, dht, clock, trusted=(0,))
    reader = make(keys, 2, dht, clock, trusted=(0,))

    def plan(epoch, leader):
        return Plan(model="m", epoch=epoch, leader_id=leader, num_layers=2, targets={"p": (0, 2)})

    async def go():
        assert await reader.get_plan() is None
        await c1.publish_plan(plan(3, "c1"))
        await rogue.publish_plan(plan(99, "rogue"))
        got = await reader.get_plan()
        assert got.plan.leader_id == "c1" and got.signer == public_key_text(keys[0])
        # the record expires and nobody republishes: the last plan stays valid
        clock.t += 60
        assert (await reader.get_plan()).plan.epoch == 3
        # all coordinators restarted and begin again at epoch 1: followed once the old one expired
        await c1.publish_plan(plan(1, "c1"))
        assert (await reader.get_plan()).plan.epoch == 1

    asyncio.run(go())


def test_config_file_and_flags(tmp_path):
    import argparse

    (tmp_path / "s.json").write_text(json.dumps({
        "swarm_id": "x", "model": "m", "initial_peers": ["/ip4/1.2.3.4/tcp/1/p2p/Qm"],
        "trusted_coordinators": [], "timing": {"peer_refresh": 1.5, "handover_max_wait": 30},
    }))
    p = argparse.ArgumentParser()
    add_dht_arguments(p)
    cfg, _ = dht_config_from_args(p.parse_args(["--config", str(tmp_path / "s.json"), "--swarm-id", "y"]))
    assert cfg.swarm_id == "y" and cfg.model == "m" and cfg.peer_refresh == 1.5 and cfg.initial_peers
    assert cfg.handover_max_wait == 30.0
    with pytest.raises(ConfigError):
        dht_config_from_args(p.parse_args([]))
    (tmp_path / "bad.toml").write_text("model = ")
    with pytest.raises(ConfigError):
        dht_config_from_args(p.parse_args(["--config", str(tmp_path / "bad.toml")]))
