"""A populated in-memory swarm for the dashboard's tests: three peers over eight layers, links,
a coordinator's plan with flows, and a client's service report.

``hostile`` puts markup into every string a peer controls (device, version; a peer id cannot
carry it: readers derive it from the signing key), to check that the page shows it as text.
"""

from __future__ import annotations

from typing import Optional

from p2pserve.config import DHTConfig
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.records import CoordinatorCandidate, Flow, LinkInfo, LinkStat, PeerInfo, Plan
from p2pserve.dht.reports import ObservedRate, ServiceReports
from p2pserve.testing.swarm import FakeSwarm, FakeSwarmStore
from p2pserve.types import PeerId

NUM_LAYERS = 8
MODEL = "m"
#: served ranges of the fake peers: peerA and peerC both hold [4, 8)
SPANS = {"peerA": (0, 4), "peerB": (4, 8), "peerC": (4, 8)}
#: markup that runs script if a page renders it as HTML
HOSTILE = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'


def _peer(pid: str, span: tuple[int, int], now: float, text: Optional[str]) -> PeerInfo:
    return PeerInfo(model=MODEL, peer_id=pid, addrs=[f"/ip4/127.0.0.1/tcp/4000/p2p/{pid}"],
                    device=text or "cpu", version=text or "0.1.0", throughput_decode=[100.0 / j for j in range(1, 9)],
                    max_layers=NUM_LAYERS, serving=span, state="serving", kv_free_tokens=4096, queued_tokens=3,
                    relayed=pid == "peerC", timestamp=now)


def _plan(now: float) -> Plan:
    flows = [Flow("source", "peerA", 20.0), Flow("peerA", "peerB", 12.0), Flow("peerA", "peerC", 8.0),
             Flow("peerB", "sink", 12.0), Flow("peerC", "sink", 8.0)]
    return Plan(model=MODEL, epoch=3, leader_id="coord", num_layers=NUM_LAYERS, targets=dict(SPANS), spans=dict(SPANS),
                flows=flows, max_flow=20.0, upper_bound=25.0, solve_time=0.01, created_at=now, reason="join")


def _put(store: FakeSwarmStore, name: str, kind: RecordKind, record) -> None:
    record.validate()  # as an honest member's announce does
    store.put(kind, "key-" + name, record)


def fake_dashboard_swarm(now: float = 1000.0, hostile: bool = False) -> FakeSwarm:
    """A reader's view (``FakeSwarm`` named "viewer") of a store holding the records above."""
    store = FakeSwarmStore()
    text = HOSTILE if hostile else None
    for pid, span in SPANS.items():
        _put(store, pid, RecordKind.PEERS, _peer(pid, span, now, text if pid == "peerB" else None))
        others = {o: LinkStat(bandwidth=12.5e6, rtt=0.002, measured_at=now) for o in SPANS if o != pid}
        _put(store, pid, RecordKind.LINKS, LinkInfo(model=MODEL, peer_id=pid, links=others, timestamp=now))
    _put(store, "coord", RecordKind.COORDINATORS,
         CoordinatorCandidate(model=MODEL, coordinator_id="coord", priority=1, start_time=now, public_key="key-coord"))
    _put(store, "coord", RecordKind.PLAN, _plan(now))
    rates = [ObservedRate(peer_id=p, layers=4, samples=16, rate=rate, wall_rate=rate * 0.8, observed_at=now)
             for p, rate in (("peerA", 50.0), ("peerB", 40.0))]
    _put(store, "client", RecordKind.REPORTS,
         ServiceReports(model=MODEL, reporter_id="client", rates=rates, timestamp=now))
    return FakeSwarm(store, "viewer", DHTConfig(model=MODEL, num_layers=NUM_LAYERS))


def kill_peer(view: FakeSwarm, peer_id: PeerId) -> None:
    """``peer_id`` crashed: its peer and link records are gone (expired, no tombstone)."""
    view.store.drop(RecordKind.PEERS, "key-" + peer_id)
    view.store.drop(RecordKind.LINKS, "key-" + peer_id)
