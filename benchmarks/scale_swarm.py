"""The control plane on a synthetic swarm of announced peers (section ``swarm`` of
``benchmarks/scale.py``).

N signed identities (a generated cluster's nodes: throughput tables, bounded links) are announced
by one DHT node holding every key (:mod:`p2pserve.dht.multi_identity`); a coordinator node and a
client node join it (three DHT nodes, each its own hivemind process and libp2p daemon). Measured:

* round 1 -- the coordinator reads every PeerInfo and LinkInfo, plans (``make_plan``: the planner
  at scale) and publishes the plan as an index and one chunk per region (``dht/plan_store.py``;
  regions from the links it read) -- the single ``Plan`` record is only measured: with its
  defaulted links it grows with the square of the peers, and a value near 64 KiB can kill the
  hivemind DHT process that stores it;
* the peers announce that they serve their targets;
* round 2 -- read, plan (flows over the served ranges) and publish again;
* the client's first route: read the index and one region's chunks, build the route graph,
  draw a route.

Each phase is wall time on this machine, including the DHT round trips over loopback.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

from p2pserve.client.routing import RouteGraph, Router
from p2pserve.clock import wall
from p2pserve.config import CoordinatorConfig, DHTConfig
from p2pserve.coordinator.plan_record import make_plan
from p2pserve.coordinator.snapshot import Snapshot
from p2pserve.coordinator.targets import build_topology
from p2pserve.coordinator.trigger import Reason, Trigger
from p2pserve.dht.multi_identity import identity_swarms
from p2pserve.dht.plan_chunks import delta, encode, split_plan
from p2pserve.dht.plan_store import publish_chunked, read_route_plan
from p2pserve.dht.records import encode_record
from p2pserve.dht.signing import load_or_create_key
from p2pserve.dht.swarm import Swarm
from p2pserve.placement.regions import find_regions
from p2pserve.placement.topology import Topology
from p2pserve.testing.synthetic_swarm import announce_all


async def _round(coord: Swarm, cfg: CoordinatorConfig, model: str, current: dict, epoch: int,
                 trigger: Trigger, previous: Any = None) -> tuple[Any, Any, dict[str, Any]]:
    """One coordinator round: read, solve, publish; (plan, seconds per phase)."""
    t0 = time.perf_counter()
    peers = await coord.get_peers()
    links = await coord.get_links()
    snap = Snapshot.from_records({pid: s.record for pid, s in peers.items()}, [s.record for s in links.values()])
    t1 = time.perf_counter()
    plan = make_plan(snap, current, epoch=epoch, leader_id=coord.peer_id, model=model, cfg=cfg,
                     reason=Reason(trigger), now=wall())
    t2 = time.perf_counter()
    index, chunks = split_plan(plan, _groups(snap, cfg))
    index, fresh = delta(previous, index, chunks)
    ok = await publish_chunked(coord, index, fresh)
    t3 = time.perf_counter()
    return plan, index, {
        "peers_read": len(peers), "links_read": sum(len(s.record.links) for s in links.values()),
        "read_s": t1 - t0, "solve_s": t2 - t1, "publish_s": t3 - t2, "total_s": t3 - t0, "published": bool(ok),
        "single_plan_bytes": len(encode_record(plan)), "defaulted_links": len(plan.defaulted_links),
        "chunks": len(chunks), "chunks_stored": len(fresh), "largest_chunk_bytes": max(len(encode(c)) for c in chunks),
        "index_bytes": len(encode(index)), "targets": len(plan.targets), "flows": len(plan.flows)}


def _groups(snap: Snapshot, cfg: CoordinatorConfig) -> dict[str, str]:
    """Peer id -> region name, regions found from the links the coordinator read."""
    ids = snap.plannable()
    topo, _ = build_topology(snap, ids, cfg)
    return {ids[i]: f"r{r}" for r, members in enumerate(find_regions(topo)) for i in members}


async def bench_swarm(topo: Topology, model: str) -> dict[str, Any]:
    """Every figure of the section for the peers of ``topo``."""
    t = time.perf_counter()
    keys = [load_or_create_key(None) for _ in range(topo.num_nodes)]
    out: dict[str, Any] = {"peers": topo.num_nodes, "keygen_s": time.perf_counter() - t}
    dcfg = DHTConfig(model=model, num_layers=topo.num_layers, host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                     peer_refresh=120.0, link_refresh=600.0, plan_refresh=120.0)
    swarms = identity_swarms(dcfg, keys)
    joined = replace(dcfg, initial_peers=tuple(swarms[0].visible_maddrs()))
    coord = Swarm.create(joined)
    client = Swarm.create(replace(joined, client_mode=True))
    try:
        t = time.perf_counter()
        out["announced"] = await announce_all(swarms, topo, model)
        out["announce_s"] = time.perf_counter() - t
        ccfg = CoordinatorConfig(num_layers=topo.num_layers, activation_bytes=topo.activation_bytes,
                                 token_bytes=topo.token_bytes)
        plan, index, out["round1"] = await _round(coord, ccfg, model, {}, 1, Trigger.INITIAL)
        t = time.perf_counter()
        await announce_all(swarms, topo, model, serving=dict(plan.targets), links=False)
        out["serve_announce_s"] = time.perf_counter() - t
        _, _, out["round2"] = await _round(coord, ccfg, model, dict(plan.targets), 2, Trigger.SERVED_RANGES, index)
        t = time.perf_counter()
        got = await read_route_plan(client)
        route = Router(RouteGraph.from_plan(got), seed=1).route_ids() if got is not None else []
        out["client"] = {"route_s": time.perf_counter() - t, "epoch": got.epoch if got else None,
                         "peers_read": len(got.spans) if got else 0, "route_hops": len(route)}
    finally:
        for node in (client, coord, swarms[0]):
            node.shutdown()
    return out


def run(topo: Topology, model: str) -> dict[str, Any]:
    """Synchronous entry point."""
    return asyncio.run(bench_swarm(topo, model))
