"""Bounded probing: a peer probes its region and a small rotating sample, never everyone."""

from __future__ import annotations

from p2pserve.dht.probe_set import ProbeSetConfig, links_to_keep, probe_set

CFG = ProbeSetConfig(region_cap=10, discover=3, sample=4, rotate=5)


def swarm(n: int, regions: int) -> tuple[list[str], dict[str, int]]:
    peers = [f"peer{x:04d}" for x in range(n)]
    return peers, {p: x % regions for x, p in enumerate(peers)}


def rtts(me: str, peers: list[str], region: dict[str, int]) -> dict[str, float]:
    return {p: (0.002 if region[p] == region[me] else 0.1) for p in peers if p != me}


def test_the_probe_set_is_bounded_whatever_the_swarm_size():
    for n in (50, 500, 2000):
        peers, region = swarm(n, 5)
        me = peers[0]
        for measured in ({}, rtts(me, peers, region)):
            chosen = probe_set(me, peers, measured, round_no=0, cfg=CFG)
            assert me not in chosen
            assert len(chosen) <= CFG.bound


def test_the_region_is_probed_nearest_first_and_the_rest_sampled():
    peers, region = swarm(200, 5)
    me = peers[0]
    measured = rtts(me, peers, region)
    measured[peers[5]] = 0.001  # the nearest neighbour
    chosen = probe_set(me, peers, measured, 0, CFG)
    same = [p for p in chosen if region[p] == region[me]]
    assert len(same) == CFG.region_cap and peers[5] in same
    assert len(chosen) - len(same) == CFG.sample


def test_unknown_peers_are_discovered_a_few_per_round():
    peers, _ = swarm(100, 5)
    chosen = probe_set(peers[0], peers, {}, 0, CFG)
    assert len(chosen) == CFG.discover + CFG.sample


def test_the_sample_rotates_between_periods_and_is_stable_within_one():
    peers, region = swarm(300, 5)
    me = peers[0]
    measured = rtts(me, peers, region)
    a = probe_set(me, peers, measured, 0, CFG)
    assert probe_set(me, peers, measured, CFG.rotate - 1, CFG) == a
    assert probe_set(me, peers, measured, CFG.rotate, CFG) != a


def test_announced_links_grow_with_peers_not_their_square():
    totals = []
    for n in (100, 400):
        peers, region = swarm(n, 5)
        total = 0
        for me in peers:
            measured = rtts(me, peers, region)
            current = probe_set(me, peers, measured, 0, CFG)
            total += len(links_to_keep(measured, current, me, peers, CFG))
        totals.append(total)
    assert totals[1] <= 4 * totals[0]  # 4x the peers: at most 4x the links
    assert totals[1] <= 400 * CFG.bound
