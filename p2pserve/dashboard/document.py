"""The ``/api/swarm`` document: :func:`swarm_document` builds it from a :class:`SwarmSnapshot`
(pure, unit-tested; the page in ``static/`` only draws it).

Top-level keys: ``schema``, ``source`` (which process serves it: ``status``, ``coordinator`` or
``api``), ``model``, ``swarm_id``, ``generated_at`` (DHT time), ``num_layers``;

* ``peers`` — :func:`~p2pserve.dashboard.swarm_status.collect_status`'s rows (``peer_id``,
  ``state``, ``start``/``end`` = the served range, ``loading``, ``target``, ``device``,
  ``version``, ``relayed``, ``kv_free_tokens``, ``decode_tps`` = measured at the served size,
  claimed/effective rate) plus what clients observed (``observed_tps``, ``observed_wall_tps``,
  ``observed_by``: reporters, ``observed_layers``);
* ``coverage`` — per layer, how many peers serve it, how many are loading it, and how many the
  plan's spans give it;
* ``plan`` — ``epoch``, ``leader``, ``flows`` (``src``, ``dst``, ``tokens_per_s``), ``ranges``
  (each peer's span and target) and the rest of the status's plan, or None;
* ``links`` — ``src``, ``dst``, ``bandwidth_Bps``, ``rtt_s``;
* ``routes`` — this process's recent requests (``api`` only: :mod:`~p2pserve.dashboard.requests`),
  ``observations`` — which peers each reporting client used, and at what rate;
* ``history`` — tokens/s over time (:mod:`~p2pserve.dashboard.history`);
* ``coordinators``, ``leader``, ``accusations``, ``excluded`` — as ``p2pserve status --json``.

Every string in it came from the network: the page renders them as text, never as markup.
"""

from __future__ import annotations

import statistics
from typing import Any, Optional, Sequence

from p2pserve.dashboard.snapshot import SwarmSnapshot
from p2pserve.dashboard.swarm_status import collect_status
from p2pserve.dht.records import MAX_LAYERS, PeerInfo
from p2pserve.dht.reports import ServiceReports

SCHEMA = 1
MAX_OBSERVATIONS = 50  # reporting clients listed (newest first)


def observed_rates(reports: Sequence[ServiceReports]) -> dict[str, dict[str, Any]]:
    """Per peer, the medians over its reporters of the one-session decode rate with the link
    RTT taken out (``observed_tps``) and as measured (``observed_wall_tps``), how many clients
    reported it, and the layer count of the newest report."""
    seen: dict[str, list] = {}
    for rep in reports:
        for r in rep.rates:
            seen.setdefault(r.peer_id, []).append(r)
    out = {}
    for pid, rates in seen.items():
        newest = max(rates, key=lambda r: r.observed_at)
        out[pid] = {"observed_tps": statistics.median(r.rate for r in rates),
                    "observed_wall_tps": statistics.median(r.wall_rate for r in rates),
                    "observed_by": len(rates), "observed_layers": newest.layers}
    return out


def layer_count(peers: dict[str, PeerInfo], snap: SwarmSnapshot, num_layers: Optional[int]) -> int:
    """The model's layer count: as known to the reader, else the plan's, else the highest
    announced range end (at most ``MAX_LAYERS``)."""
    if num_layers:
        return num_layers
    if snap.plan is not None:
        return snap.plan.plan.num_layers
    ends = [span[1] for p in peers.values() for span in (p.serving, p.loading) if span is not None]
    return min(max(ends, default=0), MAX_LAYERS)


def coverage(peers: dict[str, PeerInfo], snap: SwarmSnapshot, num_layers: int) -> dict[str, Any]:
    """How many peers serve each layer (draining peers, which clients route around, not
    counted), how many are loading it, and how many spans of the plan hold it."""
    serving, loading = [0] * num_layers, [0] * num_layers
    for p in peers.values():
        if p.serving is not None and p.state != "draining":
            for layer in range(p.serving[0], min(p.serving[1], num_layers)):
                serving[layer] += 1
        if p.loading is not None:
            for layer in range(p.loading[0], min(p.loading[1], num_layers)):
                loading[layer] += 1
    plan = snap.plan.plan if snap.plan is not None and snap.plan.plan.num_layers == num_layers else None
    return {"num_layers": num_layers, "serving": serving, "loading": loading,
            "planned": plan.coverage() if plan is not None else None,
            "uncovered": [i for i, c in enumerate(serving) if c == 0]}


def observations(reports: Sequence[ServiceReports]) -> list[dict[str, Any]]:
    """Which peers each reporting client used lately, and the rates it saw (newest first)."""
    newest = sorted(reports, key=lambda r: -r.timestamp)[:MAX_OBSERVATIONS]
    return [{"reporter": r.reporter_id, "at": r.timestamp,
             "peers": [{"peer_id": x.peer_id, "layers": x.layers, "samples": x.samples,
                        "tokens_per_s": x.rate, "wall_tokens_per_s": x.wall_rate} for x in r.rates]}
            for r in newest]


def _plan_extras(doc_plan: dict[str, Any], snap: SwarmSnapshot) -> None:
    p = snap.plan.plan
    doc_plan["leader"] = p.leader_id
    doc_plan["ranges"] = [{"peer_id": pid, "start": int(s[0]), "end": int(s[1]),
                           "target": [int(x) for x in p.targets[pid]] if pid in p.targets else None}
                          for pid, s in sorted(p.spans.items(), key=lambda kv: (kv[1][0], kv[1][1], kv[0]))]


def swarm_document(snap: SwarmSnapshot, *, source: str, model: str, swarm_id: str,
                   num_layers: Optional[int] = None, routes: Optional[list] = None,
                   history: Optional[dict] = None, trusted_verifiers: tuple[str, ...] = (),
                   max_links: int = 4096) -> dict[str, Any]:
    """The ``/api/swarm`` document of ``snap`` (see the module docstring). ``routes`` are this
    process's recent requests (None: it makes none); links are kept between live peers only,
    at most ``max_links`` of them."""
    doc = collect_status(snap.peers, snap.links, snap.candidates, snap.plan, snap.taken_at, snap.reports,
                         snap.evidence, trusted_verifiers)
    seen = observed_rates(snap.reports)
    unseen = {"observed_tps": None, "observed_wall_tps": None, "observed_by": 0, "observed_layers": None}
    for row in doc["peers"]:
        row.update(seen.get(row["peer_id"], unseen))
    live = set(snap.peers)
    doc["links"] = [li for li in doc["links"] if li["src"] in live and li["dst"] in live][:max_links]
    if doc["plan"] is not None:
        _plan_extras(doc["plan"], snap)
    layers = layer_count(snap.peers, snap, num_layers)
    doc.update({
        "schema": SCHEMA, "source": source, "model": model, "swarm_id": swarm_id,
        "generated_at": snap.taken_at, "num_layers": layers,
        "coverage": coverage(snap.peers, snap, layers),
        "routes": routes, "observations": observations(snap.reports),
        "history": history,
    })
    return doc
