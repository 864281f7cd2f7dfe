"""The control plane on a synthetic swarm of announced peers (section ``swarm`` of
``benchmarks/scale.py``).

N signed identities (a generated cluster's nodes: throughput tables, bounded links) are announced
by one DHT node holding every key (:mod:`p2pserve.dht.multi_identity`); a coordinator node and a
client node join it (three DHT nodes, each its own hivemind process and libp2p daemon). Measured:

* round 1 -- the coordinator reads every PeerInfo and LinkInfo, plans (``make_plan``: the planner
  at scale over the links that were measured) and publishes the plan the way the coordinator
  does (``Swarm.publish_plan``: an index and one chunk per cell, ``dht/plan_store.py``) -- the
  single ``Plan`` record is only measured: a value over about 16 KiB can kill the hivemind DHT
  process that stores it;
* the peers announce that they serve their targets;
* round 2 -- read, plan (flows over the served ranges) and publish again (a delta);
* the client's first route: read the followed index and one group's chunks, build the route
  graph, draw a route; and a full read (``Swarm.get_plan``: every chunk, what peers and clients
  do today).

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
from p2pserve.coordinator.trigger import Reason, Trigger
from p2pserve.dht.multi_identity import identity_swarms
from p2pserve.dht.plan_chunks import encode, split_plan
from p2pserve.dht.records import CoordinatorCandidate, encode_record
from p2pserve.dht.signing import load_or_create_key
from p2pserve.dht.swarm import Swarm
from p2pserve.placement.topology import Topology
from p2pserve.testing.synthetic_swarm import announce_all


async def _round(coord: Swarm, cfg: CoordinatorConfig, model: str, current: dict, epoch: int,
                 trigger: Trigger, cells: Any = None) -> tuple[Any, dict[str, Any]]:
    """One coordinator round: read, solve, publish; (plan, seconds per phase)."""
    t0 = time.perf_counter()
    peers, links = await asyncio.gather(coord.get_peers(), coord.get_links())  # as the coordinator reads
    snap = Snapshot.from_records({pid: s.record for pid, s in peers.items()}, [s.record for s in links.values()])
    t1 = time.perf_counter()
    plan = make_plan(snap, current, epoch=epoch, leader_id=coord.peer_id, model=model, cfg=cfg,
                     reason=Reason(trigger), now=wall(), cells=cells or {})
    t2 = time.perf_counter()
    ok = await coord.publish_plan(plan)
    t3 = time.perf_counter()
    index, chunks = split_plan(plan, {})
    return plan, {
        "peers_read": len(peers), "links_read": sum(len(s.record.links) for s in links.values()),
        "read_s": t1 - t0, "solve_s": t2 - t1, "publish_s": t3 - t2, "total_s": t3 - t0, "published": bool(ok),
        "single_plan_bytes": len(encode_record(plan)), "defaulted_links": len(plan.defaulted_links),
        "chunks": len(chunks), "largest_chunk_bytes": max(len(encode(c)) for c in chunks),
        "index_bytes": len(encode(index)), "targets": len(plan.targets), "flows": len(plan.flows),
        "method": plan.reason}


async def bench_swarm(topo: Topology, model: str) -> dict[str, Any]:
    """Every figure of the section for the peers of ``topo``."""
    t = time.perf_counter()
    keys = [load_or_create_key(None) for _ in range(topo.num_nodes)]
    out: dict[str, Any] = {"peers": topo.num_nodes, "keygen_s": time.perf_counter() - t}
    dcfg = DHTConfig(model=model, num_layers=topo.num_layers, host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                     peer_refresh=120.0, link_refresh=600.0, plan_refresh=120.0, candidate_refresh=120.0)
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
        # an open swarm: clients follow the elected candidate's plan only
        await coord.announce_candidate(CoordinatorCandidate(model=model, coordinator_id=coord.peer_id,
                                                            start_time=wall(), public_key=coord.public_key))
        plan, out["round1"] = await _round(coord, ccfg, model, {}, 1, Trigger.INITIAL)
        t = time.perf_counter()
        await announce_all(swarms, topo, model, serving=dict(plan.targets), links=False)
        out["serve_announce_s"] = time.perf_counter() - t
        _, out["round2"] = await _round(coord, ccfg, model, dict(plan.targets), 2, Trigger.SERVED_RANGES,
                                        plan.cells)
        t = time.perf_counter()
        found = await client.read_plans("")
        got = found[0][0].plan if found else None
        route = Router(RouteGraph.from_plan(got), seed=1).route_ids() if got is not None else []
        out["client"] = {"route_s": time.perf_counter() - t, "epoch": got.epoch if got else None,
                         "peers_read": len(got.spans) if got else 0, "route_hops": len(route)}
        t = time.perf_counter()
        full = await client.get_plan()
        route = Router(RouteGraph.from_plan(full.plan), seed=1).route_ids() if full is not None else []
        out["client_full"] = {"route_s": time.perf_counter() - t, "epoch": full.plan.epoch if full else None,
                              "peers_read": len(full.plan.spans) if full else 0, "route_hops": len(route)}
    finally:
        for node in (client, coord, swarms[0]):
            node.shutdown()
    return out


def run(topo: Topology, model: str) -> dict[str, Any]:
    """Synchronous entry point."""
    return asyncio.run(bench_swarm(topo, model))
