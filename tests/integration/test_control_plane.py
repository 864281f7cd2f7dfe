"""Control plane end to end: real DHT nodes and real processes on loopback.

One bootstrap node, two trusted coordinators and four synthetic peers (real DHT nodes that
publish real signed PeerInfo/LinkInfo records, probe links, and follow the plan) start from
nothing; the tests then check election, plan coverage, join, crash, forged / untrusted /
absurd records, the status command and leader failover. They share the swarm, but each one
first waits for the state it asserts on (:func:`settled_plan`) and starts the members it
needs, so each passes when run alone. Synthetic peers let these tests forge and misreport
what real ones never would; the same scenario with real peer processes serving a model is
`test_swarm_peers.py`.

Refresh periods are shortened (0.5-2 s) so the file stays well under two minutes. No test
asserts a duration: deadlines are generous upper bounds for a loaded two-core machine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import hivemind
import pytest
from hivemind.dht.validation import RecordValidatorBase

from p2pserve.clock import wall
from p2pserve.config import DHTConfig, ProberConfig
from p2pserve.dht.keys import RecordKind, record_key
from p2pserve.dht.plan_store import index_key
from p2pserve.dht.prober import LinkProber
from p2pserve.dht.records import PeerInfo, Plan, encode_record
from p2pserve.dht.signing import load_or_create_key, owner_subkey, public_key_text
from p2pserve.dht.swarm import Swarm
from tests.integration.processes import Procs
from tests.support import wait_for

pytestmark = pytest.mark.integration

MODEL = "tiny-8"
NUM_LAYERS = 8
# short periods; the 2 s skew floor keeps TTLs >= 2 s so that a loaded machine does not make a
# live coordinator's candidacy lapse between two refreshes
# (plans are republished at once on every change; plan_refresh only keeps an unchanged one alive)
TIMING = dict(peer_refresh=0.5, candidate_refresh=0.5, plan_refresh=3.0, link_refresh=2.0, max_clock_skew=2.0)
DEADLINE = 60.0  # generous: seconds on a loaded 2-core machine, not a performance claim


_LOOP: asyncio.AbstractEventLoop | None = None


def run(coro):
    """Run a coroutine on this module's own loop (``asyncio.run`` elsewhere may unset the default)."""
    global _LOOP
    if _LOOP is None or _LOOP.is_closed():
        _LOOP = asyncio.new_event_loop()
    return _LOOP.run_until_complete(coro)


@pytest.fixture(scope="module", autouse=True)
def loop():
    yield
    if _LOOP is not None and not _LOOP.is_closed():
        _LOOP.run_until_complete(_LOOP.shutdown_asyncgens())
        _LOOP.close()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """Bootstrap + 2 coordinators + 4 synthetic peers, and an in-process observer."""
    tmp = tmp_path_factory.mktemp("control_plane")
    procs = Procs(tmp)
    observer = None
    try:
        keys = {n: str(tmp / f"{n}.key") for n in ("coord-1", "coord-2", "rogue")}
        pub = {n: public_key_text(load_or_create_key(path)) for n, path in keys.items()}
        maddrs_file = tmp / "boot.maddrs"
        procs.start("bootstrap", ["-m", "p2pserve.cli", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                  "--maddrs-file", str(maddrs_file)])
        wait_for(maddrs_file.exists, "bootstrap multiaddrs")
        boot = maddrs_file.read_text().split()
        config = {
            "swarm_id": "cp-test",
            "model": MODEL,
            "initial_peers": boot,
            "host_maddrs": ["/ip4/127.0.0.1/tcp/0"],
            "trusted_coordinators": [pub["coord-1"], pub["coord-2"]],
            "timing": TIMING,
            "models": {MODEL: {"num_layers": NUM_LAYERS, "activation_bytes": 4096, "solve_time_limit": 0.5}},
        }
        cfg_path = tmp / "swarm.json"
        cfg_path.write_text(json.dumps(config))
        for name, prio in (("coord-1", 2), ("coord-2", 1)):
            procs.start(name, ["-m", "p2pserve.cli", "coordinator", "--config", str(cfg_path), "--key-path", keys[name],
                               "--priority", str(prio), "--coordinator-id", name])
        for i in range(1, 5):
            start_peer(procs, f"peer-{i}", cfg_path)
        # misbehaving members start with everyone else (their start-up overlaps; both must be
        # ignored from the first moment): an untrusted coordinator with the highest priority,
        # and a peer announcing 10^12 tokens/s
        procs.start("rogue", ["-m", "p2pserve.cli", "coordinator", "--config", str(cfg_path), "--key-path",
                              keys["rogue"], "--priority", "100", "--coordinator-id", "rogue"])
        start_peer(procs, "absurd", cfg_path, "--absurd", "--no-probe")
        observer = Swarm.create(DHTConfig(
            model=MODEL, swarm_id="cp-test", initial_peers=tuple(boot), host_maddrs=("/ip4/127.0.0.1/tcp/0",),
            trusted_coordinators=(pub["coord-1"], pub["coord-2"]), client_mode=True, reject_log_interval=0.0, **TIMING,
        ))
        yield dict(procs=procs, observer=observer, cfg=cfg_path, keys=keys, pub=pub, boot=boot, tmp=tmp)
    finally:
        if observer is not None:
            observer.shutdown()
        procs.close()


def start_peer(procs: Procs, name: str, cfg_path: Path, *extra: str) -> None:
    procs.start(name, ["-m", "p2pserve.testing.synthetic_peer", "--config", str(cfg_path), "--max-layers", "4",
                       "--tps", "400", "--load-delay", "0.5", "--device", name, *extra])


def peer_id_of(procs: Procs, name: str) -> str:
    """The peer id ``name`` printed last (a restarted member prints a new one)."""
    def find():
        ids = [line.split()[1] for line in procs.log(name).splitlines() if line.startswith("peer ")]
        return ids[-1] if ids else None

    return wait_for(find, f"{name} to print its peer id")


def current_plan(obs: Swarm):
    sp = run(obs.get_plan())
    return None if sp is None else sp.plan


def full_and_serving(plan: Plan | None, peers: set[str]) -> bool:
    """Plan targets exactly ``peers``, and the ranges served now cover every layer with flow."""
    return (
        plan is not None
        and set(plan.targets) == peers
        and set(plan.spans) == peers
        and min(plan.coverage()) >= 1
        and plan.max_flow > 0
    )


BASE_PEERS = tuple(f"peer-{i}" for i in range(1, 5))


def settled_plan(swarm, extra: tuple[str, ...] = (), leader: str | None = None) -> Plan:
    """The state most tests start from: a leader's plan that targets exactly the four base peers
    (and ``extra``), all serving, every layer covered (and, given ``leader``, published by that
    coordinator). Waits for it, restarting a base peer a test stopped."""
    procs = swarm["procs"]
    for name in BASE_PEERS:
        procs.ensure(name)
    ids = {peer_id_of(procs, n) for n in BASE_PEERS + extra}
    return wait_for(lambda: ((p := current_plan(swarm["observer"])) and full_and_serving(p, ids)
                             and leader in (None, p.leader_id) and p),
                    "a plan serving every layer over the base peers" + (f" and {extra}" if extra else "")
                    + (f", published by {leader}" if leader else ""))


def test_leader_elected_and_every_layer_served(swarm):
    # On a loaded machine coord-2 may publish a full plan before coord-1's candidacy is seen; the
    # election's outcome is that the highest priority leads from then on, so that is what is waited for.
    plan = settled_plan(swarm, leader="coord-1")
    assert plan.leader_id == "coord-1"  # highest priority
    assert plan.num_layers == NUM_LAYERS
    assert min(plan.coverage(use_targets=True)) >= 1
    srcs = {f.dst for f in plan.flows if f.src == "source"}
    assert srcs and all(plan.spans[p][0] == 0 for p in srcs)
    cands = run(swarm["observer"].get_candidates())
    assert {c.record.coordinator_id for c in cands} <= {"coord-1", "coord-2"}


def test_links_are_measured_and_announced(swarm):
    settled_plan(swarm)
    obs = swarm["observer"]
    links = wait_for(lambda: (ls := run(obs.get_links())) and len(ls) >= 2 and ls, "LinkInfo records")
    stats = [s for li in links.values() for s in li.record.links.values()]
    assert stats and all(s.bandwidth > 0 and s.rtt > 0 for s in stats)


class ForgingValidator(RecordValidatorBase):
    """Signs records that claim ``victim``'s subkey with ``forger``'s key (and accepts them locally)."""

    def __init__(self, forger):
        self.forger = forger

    def validate(self, record):
        return True

    def sign_value(self, record):
        sig = self.forger.sign(record.key + record.subkey + record.value)
        return record.value + b"[signature:" + sig + b"]"

    def strip_value(self, record):
        return record.value.split(b"[signature:")[0]


def test_record_with_wrong_signature_is_ignored(swarm, caplog):
    obs, boot, procs = swarm["observer"], swarm["boot"], swarm["procs"]
    settled_plan(swarm)
    victim, forger = load_or_create_key(None), load_or_create_key(None)
    dht = hivemind.DHT(initial_peers=boot, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True,
                       record_validators=[ForgingValidator(forger)])
    try:
        fake = PeerInfo(model=MODEL, peer_id="forged-peer", max_layers=4, throughput_decode=[9e4] * 4,
                        serving=(0, 4), state="serving", timestamp=time.time())
        key = record_key("cp-test", MODEL, RecordKind.PEERS)
        refused_before = sum(procs.log(n).count("signature does not match") for n in procs.procs)

        def refused_with_reason():
            dht.store(key, encode_record(fake), wall() + 30, subkey=owner_subkey(victim))
            # honest nodes that were asked to store it say why they refused, in their own logs
            return sum(procs.log(n).count("signature does not match") for n in procs.procs) > refused_before

        wait_for(refused_with_reason, "an honest node to refuse the forged record", interval=1.0)
        for _ in range(3):
            assert "forged-peer" not in run(obs.get_peers())
            time.sleep(0.3)
        plan = current_plan(obs)
        assert "forged-peer" not in plan.targets and "forged-peer" not in plan.spans
    finally:
        dht.shutdown()


def test_plan_from_untrusted_coordinator_is_ignored(swarm, caplog):
    procs, obs = swarm["procs"], swarm["observer"]
    rogue_key = swarm["pub"]["rogue"]
    procs.ensure("rogue")  # started with everyone else by the fixture
    settled_plan(swarm)

    def rogue_plan_in_dht():
        return any(signer == rogue_key for signer, _, _ in run(obs.fetch_owned(index_key(obs))))

    with caplog.at_level(logging.WARNING, logger="p2pserve.dht.swarm"):
        wait_for(rogue_plan_in_dht, "the rogue coordinator to publish")  # it believes it leads
        # one DHT read can miss the trusted plan while it is being refreshed: wait for a read
        # that returns plans, then check none of them is the rogue's
        plans = wait_for(lambda: run(obs.get_plans()), "a read returning the accepted plans")
        assert plans and all(p.signer != rogue_key for p in plans)
        assert current_plan(obs).leader_id in ("coord-1", "coord-2")
        assert "rogue" not in {c.record.coordinator_id for c in run(obs.get_candidates())}
    assert "not in trusted_coordinators" in caplog.text
    procs.stop("rogue")  # frees its share of the two cores


def test_absurd_figures_are_ignored_with_a_reason(swarm, caplog):
    procs, obs = swarm["procs"], swarm["observer"]
    procs.ensure("absurd")  # started with everyone else by the fixture
    bad = peer_id_of(procs, "absurd")
    with caplog.at_level(logging.WARNING, logger="p2pserve.dht.swarm"):
        def rejected():
            run(obs.get_peers())
            return "throughput_decode" in caplog.text and "1e+08" in caplog.text
        wait_for(rejected, "the absurd PeerInfo to be rejected with a reason")
    assert bad not in run(obs.get_peers())
    plan = settled_plan(swarm)  # made while the absurd peer announces
    assert bad not in plan.targets and bad not in plan.spans
    procs.stop("absurd")


def test_new_peer_receives_a_range_and_serves_it(swarm):
    procs, obs = swarm["procs"], swarm["observer"]
    before = settled_plan(swarm)
    start_peer(procs, "joiner", swarm["cfg"])
    try:
        new = peer_id_of(procs, "joiner")
        # it is part of the graph flows are computed over; whether max-flow routes through it
        # depends on where the bottleneck is, so only check that nothing got worse once the swarm
        # settled (a re-plan may still shrink or move a range, and peers flip one by one)
        plan = wait_for(lambda: (p := current_plan(obs)) and new in p.targets and p.spans.get(new) == p.targets[new]
                          and p.max_flow >= before.max_flow * 0.99 and p, "the joiner serving its target")
        # one DHT read may miss a record that is being refreshed: wait for the peer's own view
        record = wait_for(lambda: (r := run(obs.get_peers()).get(new)) and r.record, "the joiner's PeerInfo")
        assert record.state == "serving" and record.serving == plan.targets[new]
    finally:
        procs.stop("joiner")


def test_crashed_peer_is_excluded_from_the_next_plan(swarm):
    procs, obs = swarm["procs"], swarm["observer"]
    start_peer(procs, "crasher", swarm["cfg"])
    before = settled_plan(swarm, extra=("crasher",))  # placed and serving
    gone = peer_id_of(procs, "crasher")
    procs.kill("crasher")  # no withdraw: its records must expire
    plan = wait_for(lambda: (p := current_plan(obs)) and gone not in p.targets and gone not in p.spans and p,
                      "a plan without the crashed peer")
    assert plan.epoch > before.epoch
    assert min(plan.coverage()) >= 1
    assert all(gone not in (f.src, f.dst) for f in plan.flows)


def test_status_command_json(swarm, capsys):
    from p2pserve.cli import main  # in-process: the subcommand module is what is under test

    settled_plan(swarm)
    assert main(["status", "--config", str(swarm["cfg"]), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["peers"]) >= 4 and d["leader"] in ("coord-1", "coord-2")
    assert d["plan"]["epoch"] >= 1 and d["plan"]["uncovered_layers"] == [] and d["plan"]["flows"]
    assert all(p["state"] in ("joining", "loading", "serving", "draining") for p in d["peers"])
    assert main(["status", "--config", str(swarm["cfg"])]) == 0
    text = capsys.readouterr().out
    assert "PEERS" in text and "PLAN epoch" in text


def test_leader_failover_keeps_serving(swarm):
    procs, obs = swarm["procs"], swarm["observer"]
    before = settled_plan(swarm)
    leader = before.leader_id  # coord-1 unless a starved machine let its candidacy lapse
    other = {"coord-1": "coord-2", "coord-2": "coord-1"}[leader]
    procs.kill(leader)  # crash: candidacy and plan simply stop being refreshed
    try:
        # a client keeps the last plan it saw; it must cover every layer at every moment
        last = before

        def taken_over():
            nonlocal last
            p = current_plan(obs)
            if p is not None:
                last = p
            assert min(last.coverage()) >= 1 and last.max_flow > 0
            return p is not None and p.leader_id == other and p
        plan = wait_for(taken_over, f"{other} to publish", interval=0.2)
        assert plan.epoch > before.epoch
        assert plan.targets == before.targets  # the takeover keeps the placement: no reload
    finally:
        procs.ensure(leader)  # back as a candidate (it leads again once its grace has passed)


def test_prober_between_two_p2p_nodes():
    a = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    b = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[str(m) for m in a.get_visible_maddrs()])
    try:
        async def go():
            pa, pb = await a.replicate_p2p(), await b.replicate_p2p()
            cfg = ProberConfig(max_probe_bytes=8 << 20, min_interval_s=0.0)
            pra, prb = LinkProber(pa, cfg), LinkProber(pb, cfg)
            await pra.start()
            await prb.start()
            ab = await pra.probe_many({b.peer_id.to_base58(): [str(m) for m in b.get_visible_maddrs()]})
            ba = await prb.probe_many({a.peer_id.to_base58(): []})
            info = pra.link_info("m", a.peer_id.to_base58())
            for p in (pa, pb):
                await p.shutdown()  # replicas: closes our control connections, not the daemons
            return ab, ba, info

        ab, ba, info = run(go())
        for d in (ab, ba):
            (stat,) = d.values()
            assert 1e5 < stat.bandwidth < 1e11 and 0 < stat.rtt < 1.0
        info.validate()
        assert list(info.links) == [b.peer_id.to_base58()]
    finally:
        a.shutdown()
        b.shutdown()
