"""build_topology above a few dozen peers: links where measured or needed, not every pair."""

from p2pserve.config import CoordinatorConfig
from p2pserve.coordinator.snapshot import Snapshot
from p2pserve.coordinator.targets import DENSE_PEERS, NEEDED_LINKS, build_topology
from p2pserve.dht.records import LinkStat, PeerInfo
from p2pserve.types import SINK_INDEX, SOURCE_INDEX

CFG = CoordinatorConfig(num_layers=8, activation_bytes=1024)


def swarm(n: int, probed: int, unmeasured: int = 0) -> Snapshot:
    """``n`` peers, each (but the last ``unmeasured``) measuring its ``probed`` next ones."""
    ids = [f"p{x:04d}" for x in range(n)]
    peers = {pid: PeerInfo(model="m", peer_id=pid, max_layers=4, throughput_decode=[100.0, 50.0, 33.0, 25.0])
             for pid in ids}
    links = {(ids[x], ids[(x + d) % (n - unmeasured)]): LinkStat(bandwidth=1e8, rtt=0.001)
             for x in range(n - unmeasured) for d in range(1, probed + 1)}
    return Snapshot(peers, links)


def peer_links(topo):
    return [ln for ln in topo.links if SOURCE_INDEX not in (ln.src, ln.dst) and SINK_INDEX not in (ln.src, ln.dst)]


def test_small_swarms_keep_every_pair():
    snap = swarm(DENSE_PEERS, 3)
    topo, defaulted = build_topology(snap, sorted(snap.peers), CFG)
    n = DENSE_PEERS
    assert len(peer_links(topo)) == n * (n - 1)
    assert len(defaulted) == n * (n - 1) // 2 - n * 3


def test_large_swarms_link_what_was_measured_and_what_a_newcomer_needs():
    snap = swarm(300, 10, unmeasured=2)
    ids = sorted(snap.peers)
    topo, defaulted = build_topology(snap, ids, CFG)
    links = peer_links(topo)
    assert len(links) <= 2 * (298 * 10 + 2 * NEEDED_LINKS)  # grows with the peers, not their square
    measured = {(ln.src, ln.dst) for ln in links if ln.bandwidth == 1e8}
    assert len(measured) == 2 * 298 * 10  # both directions of each measured pair
    for newcomer in (298, 299):  # never measured: default links to a few peers, flagged
        mine = [ln for ln in links if ln.src == newcomer]
        assert 0 < len(mine) <= NEEDED_LINKS + 2 and all(ln.bandwidth == CFG.default_bandwidth for ln in mine)
        assert any(ids[newcomer] in pair for pair in defaulted)
    assert build_topology(snap, ids, CFG)[1] == defaulted  # the same inputs, the same links
