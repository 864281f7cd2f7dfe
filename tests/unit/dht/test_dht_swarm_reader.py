"""Swarm's reader side against a fake DHT: trust, tombstones, rejections, keep-last plan, config."""

import asyncio
import json
from pathlib import Path

import pytest

from p2pserve.cli.common import add_dht_arguments, dht_config_from_args
from p2pserve.config import DHTConfig
from p2pserve.dht.identity import peer_id_of
from p2pserve.dht.keys import RecordKind, record_key
from p2pserve.dht.records import CoordinatorCandidate, PeerInfo, Plan, encode_record
from p2pserve.dht.signing import load_or_create_key, owner_subkey, public_key_text
from p2pserve.dht.swarm import Swarm
from p2pserve.errors import ConfigError
from p2pserve.testing import FakeClock, FakeDHT

Entry = FakeDHT.Entry


@pytest.fixture(scope="module")
def keys():
    return [load_or_create_key(None) for _ in range(3)]


def make(keys, i, dht, clock, trusted=()):
    cfg = DHTConfig(model="m", swarm_id="s", trusted_coordinators=tuple(public_key_text(keys[j]) for j in trusted),
                    plan_refresh=5.0, max_clock_skew=0.0, reject_log_interval=0.0)
    return Swarm(cfg, dht, keys[i], clock=clock)


def test_reader_filters(keys, caplog):
    dht, clock = FakeDHT(), FakeClock()
    a, b = make(keys, 0, dht, clock), make(keys, 1, dht, clock)

    async def go():
        await a.announce_peer(PeerInfo(model="m", peer_id=a.peer_id))
        await b.announce_peer(PeerInfo(model="m", peer_id=b.peer_id))
        assert set(await a.get_peers()) == {a.peer_id, b.peer_id}
        # an absurd record written around local validation, and an unsigned one
        key = record_key("s", "m", RecordKind.PEERS)
        bad = PeerInfo(model="m", peer_id=peer_id_of(public_key_text(keys[2])), max_layers=1, throughput_decode=[1e12])
        dht.data[key][owner_subkey(keys[2])] = Entry(encode_record(bad), clock() + 5.0)
        dht.data[key][b"no-owner"] = Entry(encode_record(PeerInfo(model="m", peer_id="py")), clock() + 5.0)
        assert set(await a.get_peers()) == {a.peer_id, b.peer_id}
        assert "throughput_decode[1]" in caplog.text and "no owner" in caplog.text
        # withdraw: tombstone, reported as withdrawn
        await b.withdraw_all()
        assert set(await a.get_peers()) == {a.peer_id}
        assert public_key_text(keys[1]) in a.withdrawn[RecordKind.PEERS]
        # expiry
        clock.advance(100)
        assert await a.get_peers() == {}

    asyncio.run(go())


def test_candidates_must_carry_their_signers_key(keys):
    dht, clock = FakeDHT(), FakeClock()
    a = make(keys, 0, dht, clock)

    async def go():
        with pytest.raises(ConfigError):
            await a.announce_candidate(CoordinatorCandidate(model="m", coordinator_id="x", start_time=1.0,
                                                            public_key=public_key_text(keys[1])))
        key = record_key("s", "m", RecordKind.COORDINATORS)
        lie = CoordinatorCandidate(model="m", coordinator_id="liar", start_time=1.0, public_key=public_key_text(keys[1]))
        dht.data[key] = {owner_subkey(keys[2]): Entry(encode_record(lie), clock() + 5.0)}
        assert await a.get_candidates() == []

    asyncio.run(go())


def test_trusted_plans_and_keep_last(keys):
    dht, clock = FakeDHT(), FakeClock()
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
        clock.advance(60)
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


def test_merge_flags_given_win_even_when_zero_or_empty():
    from p2pserve.config.swarm_file import merge

    assert merge({"a": 1, "b": 2, "c": None}, {"a": 0, "b": None, "d": ()}) == {"a": 0, "b": 2, "d": ()}


def test_flag_set_to_zero_overrides_a_nonzero_file_value(tmp_path):
    import argparse

    from p2pserve.cli.coordinator import add_arguments, coordinator_config
    from p2pserve.config.swarm_file import SwarmFile

    path = tmp_path / "s.json"
    path.write_text(json.dumps({
        "model": "m", "initial_peers": ["/ip4/1.2.3.4/tcp/1/p2p/Qm"], "timing": {"max_clock_skew": 2.0},
        "models": {"m": {"num_layers": 8, "replan_period": 60.0, "activation_bytes": 4096}},
    }))
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--config", str(path), "--max-clock-skew", "0", "--replan-period", "0", "--initial-peers",
                         "--priority", "0"])
    cfg, file = dht_config_from_args(args)
    assert cfg.max_clock_skew == 0.0 and cfg.initial_peers == ()
    ccfg = coordinator_config(args, file, cfg.model)
    assert ccfg.replan_period == 0.0 and ccfg.num_layers == 8 and ccfg.activation_bytes == 4096
    # flags not given: the file's values, else the dataclass defaults
    args = p.parse_args(["--config", str(path)])
    cfg, file = dht_config_from_args(args)
    assert cfg.max_clock_skew == 2.0 and cfg.initial_peers and cfg.peer_refresh == DHTConfig.peer_refresh
    assert coordinator_config(args, file, "m").replan_period == 60.0
    assert isinstance(file, SwarmFile) and file.model_settings("other").values() == {}


def test_swarm_file_is_validated(tmp_path):
    from p2pserve.config.swarm_file import SwarmFile

    (tmp_path / "typo.toml").write_text('model = "m"\n[timing]\npeer_refesh = 1.0\n')
    with pytest.raises(ConfigError, match="peer_refesh"):
        SwarmFile.load(str(tmp_path / "typo.toml"))
    (tmp_path / "type.json").write_text(json.dumps({"initial_peers": "not-a-list"}))
    with pytest.raises(ConfigError, match="initial_peers"):
        SwarmFile.load(str(tmp_path / "type.json"))
    shipped = Path(__file__).resolve().parents[3] / "bootstrap" / "swarm.toml"
    assert SwarmFile.load(str(shipped)).model_settings("Qwen/Qwen2.5-0.5B-Instruct").num_layers == 24


def test_swarm_and_the_shared_fake_implement_the_swarm_view(keys):
    """The roles see only SwarmView: the hivemind Swarm and the in-memory fake both provide
    every member of it, with the same signatures."""
    import inspect

    from p2pserve.dht.view import LinkProbes, SwarmReader, SwarmView
    from p2pserve.dht.prober import LinkProber
    from p2pserve.testing import FakeSwarm

    def members(proto):
        names = set()
        for cls in proto.__mro__:
            if cls in (SwarmView, SwarmReader, LinkProbes):
                names |= {n for n in vars(cls) if not n.startswith("_")} | set(getattr(cls, "__annotations__", {}))
        return names

    def params(f):
        return [p for p in inspect.signature(f).parameters if p != "self"]

    for impl in (make(keys, 0, FakeDHT(), FakeClock()), FakeSwarm()):
        for name in members(SwarmView):
            # properties are looked up on the class (Swarm.peer_id asks its DHT node)
            assert hasattr(type(impl), name) or hasattr(impl, name), (type(impl).__name__, name)
            spec = getattr(SwarmView, name, None)
            if inspect.iscoroutinefunction(spec):
                method = getattr(type(impl), name)
                assert inspect.iscoroutinefunction(method) and params(method) == params(spec), (type(impl).__name__, name)
    prober = LinkProber(None)
    assert all(hasattr(type(prober), name) or hasattr(prober, name) for name in members(LinkProbes))


def test_an_open_swarm_follows_only_the_elected_candidates_plans_within_what_time_allows(keys):
    """A key that never stood for election publishes epoch 2**62 with leader id "0": not followed;
    nor is a live candidate that is not the leader; the leader's plan is, unless its epoch jumps
    beyond what time allows (``election.epoch_ceiling``)."""
    from p2pserve.dht.election import epoch_ceiling
    from p2pserve.dht.records import MAX_EPOCH

    dht, clock = FakeDHT(), FakeClock()
    keys = [*keys, load_or_create_key(None)]
    leader, runner_up, rogue = (make(keys, i, dht, clock) for i in range(3))
    reader = make(keys, 3, dht, clock)

    def plan(epoch, leader_id):
        return Plan(model="m", epoch=epoch, leader_id=leader_id, num_layers=2, targets={"p": (0, 2)})

    async def go():
        for swarm, (cid, priority) in ((leader, ("lead", 5)), (runner_up, ("second", 1))):
            await swarm.announce_candidate(CoordinatorCandidate(model="m", coordinator_id=cid, priority=priority,
                                                                start_time=1.0, public_key=swarm.public_key))
        await rogue.publish_plan(plan(MAX_EPOCH, "0"))
        await runner_up.publish_plan(plan(50, "second"))
        assert await reader.get_plan() is None
        await leader.publish_plan(plan(3, "lead"))
        assert (await reader.get_plan()).plan.leader_id == "lead"
        too_far = epoch_ceiling(clock() + reader.config.max_clock_skew) + 1
        await leader.publish_plan(plan(too_far, "lead"))
        assert (await reader.get_plan()).plan.epoch == 3  # the jump is dropped, the last plan stays

    asyncio.run(go())
