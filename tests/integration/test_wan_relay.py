"""A swarm across a slow network: every peer behind a delaying relay (``p2pserve.testing.delay_relay``).

One bootstrap node and three `p2pserve peer` processes on the tiny Llama ([0:4), [4:8), [4:8)),
each behind its own relay process that adds 25 ms each way and paces each direction to
40 Mbit/s. The peers announce only the relays' addresses (``--announce-maddrs``,
``--direct-announce-port``), so clients and other peers reach them through the relays alone.
The tests, in order (they share the swarm; the last one kills a peer):

* the peers' link probes read the relays' delay: every announced RTT is at least 50 ms, and no
  bandwidth reading beats the relay's rate;
* client-driven greedy generation through the relays is token-identical to `generate`, and the
  relays carried the activations (their byte counts);
* the same with the route's last peer killed mid-generation (failover through the relays).

The only timing bounds here are ones the relay enforces by construction (a byte never leaves it
early, never faster than its rate); nothing bounds how slow the machine may be.
"""

from __future__ import annotations

import asyncio

import pytest

from p2pserve.client.failover import FailoverState
from p2pserve.client.generation import Generation
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.client.params import GenerationParams
from p2pserve.client.pipeline import Pipeline
from p2pserve.client.route_providers import PeerListRoutes
from p2pserve.config import ClientConfig, DHTConfig
from p2pserve.dht.swarm import Swarm
from p2pserve.launch import Children
from p2pserve.model.identity import derived_name
from p2pserve.testing.wan import start_relayed_peers, stop_relayed_peers
from tests.harness import client_node, reference_generate
from tests.support import wait_for

pytestmark = pytest.mark.integration

DELAY_MS = 25.0
RATE_MBPS = 40.0
RANGES = [(0, 4), (4, 8), (4, 8)]
TIMING = ["--peer-refresh", "0.5", "--link-refresh", "5", "--max-clock-skew", "2"]
CONFIG = ClientConfig(hop_timeout_s=30.0, max_retries=3, ban_base_s=30.0)
GREEDY = GenerationParams(max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def swarm(model_dir, tmp_path_factory):
    """Bootstrap node, three relayed peers and an observer node reading their records."""
    tmp = tmp_path_factory.mktemp("wan")
    path = model_dir("llama")
    children = Children(tmp)
    peers, observer = [], None
    try:
        maddrs_file = tmp / "boot.maddrs"
        children.start("boot", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--maddrs-file", str(maddrs_file))
        boot = wait_for(lambda: maddrs_file.exists() and maddrs_file.read_text().split(), "the bootstrap node")
        peers = start_relayed_peers(path, RANGES, "--initial-peers", *boot, *TIMING, "--probe-max-mb", "2",
                                    delay_ms=DELAY_MS, rate_mbps=RATE_MBPS, workdir=tmp)
        observer = Swarm.create(DHTConfig(model=derived_name(path), initial_peers=tuple(boot), client_mode=True,
                                          host_maddrs=("/ip4/127.0.0.1/tcp/0",), num_layers=8))
        yield dict(path=path, peers=peers, observer=observer)
    finally:
        if observer is not None:
            observer.shutdown()
        stop_relayed_peers(peers)
        children.stop_all()


def relay_port(rp, route: int) -> str:
    return rp.relay.listening[route].rsplit(":", 1)[1]


def test_peers_announce_only_their_relays_and_probes_read_the_delay(swarm):
    peers, observer = swarm["peers"], swarm["observer"]
    ids = {rp.peer.peer_id for rp in peers}
    for rp in peers:  # what the peer prints and what it announces name the relay, nothing else
        assert all(f"/tcp/{relay_port(rp, 0)}/" in m for m in rp.peer.maddrs), rp.peer.maddrs

    # Each peer's record is read as it was last seen complete: a short-lived record may lapse
    # between two refreshes on a loaded machine, and what is checked is what the probes read,
    # not that three records are live at one instant.
    seen: dict = {}

    def links_between_all():
        for pid, s in asyncio.run(observer.get_links()).items():
            if pid in ids and set(s.record.links) >= ids - {pid}:
                seen[pid] = s.record.links
        return len(seen) == len(ids) and dict(seen)

    def missing() -> str:
        lacking = sorted(ids - set(seen))
        return f"no complete record from {lacking}; their output:\n" + "\n".join(
            rp.peer.output(1500) for rp in peers if rp.peer.peer_id in lacking)

    def peer_records():
        got = asyncio.run(observer.get_peers())
        return ids <= set(got) and got

    links = wait_for(links_between_all, "every peer's probes of the other two", timeout=150.0, explain=missing)
    infos = wait_for(peer_records, "the three peers' records")
    rate_bytes = RATE_MBPS * 1e6 / 8
    for pid, by_target in links.items():
        for target, stat in by_target.items():
            if target not in ids:
                continue
            # a round trip crosses one relay each way, so the probe must see at least twice its
            # delay (no ceiling: a loaded machine may add any amount on top)
            assert 2 * DELAY_MS / 1e3 <= stat.rtt, (pid, target, stat)
            # a transfer can over-read its link by at most 11% (dht/prober.py: bandwidth_from)
            assert 0 < stat.bandwidth <= 1.15 * rate_bytes, (pid, target, stat)


def prompt(path, text="Tell me about networks with long delays."):
    return LocalModelInfo.load(path).chat_ids([{"role": "user", "content": text}])


async def generate(path, peers, prompt_ids, kill_after: int | None = None):
    """Greedy tokens through a failover pipeline over ``peers``' relayed addresses; after
    ``kill_after`` tokens the route's last peer is SIGKILLed. Returns (tokens, pipeline)."""
    model = LocalModelInfo.load(path)
    spec = model.spec
    by_id = {rp.peer.peer_id: rp for rp in peers}
    async with client_node(CONFIG) as transport:
        routes = PeerListRoutes(spec.num_layers, [rp.peer.hop() for rp in peers], seed=0)
        pipeline = Pipeline(transport, routes, spec.model_id, spec.num_layers, 256, GREEDY.validate(), CONFIG,
                            FailoverState(CONFIG))
        gen = Generation(pipeline, prompt_ids, GREEDY, model.eos_ids)
        try:
            n = 0
            async for _ in gen:
                n += 1
                if n == kill_after:
                    await asyncio.to_thread(by_id[pipeline.route[-1].peer_id].peer.kill)
            return gen.result.tokens, pipeline
        finally:
            await pipeline.close()


def relayed_bytes(rp) -> tuple[int, int]:
    """Bytes (to, from) the peer through its relay, libp2p and direct routes together."""
    (a, b), (c, d) = rp.bytes_relayed(0), rp.bytes_relayed(1)
    return a + c, b + d


def test_greedy_generation_through_the_relays_is_identical(swarm):
    path, peers = swarm["path"], swarm["peers"]
    ids = prompt(path)
    before = {rp.peer.peer_id: relayed_bytes(rp) for rp in peers}
    tokens, pipeline = asyncio.run(generate(path, peers, ids))
    assert tokens == reference_generate(path, ids, GREEDY.max_new_tokens)
    assert not pipeline.failures
    # the prompt's hidden states [n, hidden] fp32 left the first peer and entered the second
    # through their relays (the relays rewrite their counts twice a second)
    hidden_bytes = len(ids) * LocalModelInfo.load(path).spec.hidden_size * 4
    first, second = (next(rp for rp in peers if rp.peer.peer_id == hop.peer_id) for hop in pipeline.route)

    def carried():
        return (relayed_bytes(first)[1] - before[first.peer.peer_id][1] >= hidden_bytes
                and relayed_bytes(second)[0] - before[second.peer.peer_id][0] >= hidden_bytes)

    wait_for(carried, "the relays' counts of the activations", timeout=10.0)


def test_failover_through_the_relays_is_identical(swarm):
    path, peers = swarm["path"], swarm["peers"]
    ids = prompt(path, "A peer dies far away; the output must not change.")
    tokens, pipeline = asyncio.run(generate(path, peers, ids, kill_after=6))
    assert tokens == reference_generate(path, ids, GREEDY.max_new_tokens)
    assert len(pipeline.failures) == 1 and len(pipeline.route_log) == 2
    assert pipeline.route_log[0][-1].peer_id != pipeline.route_log[1][-1].peer_id
