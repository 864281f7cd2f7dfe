"""``ServiceReports``: service rates a client observed at the peers it used (a signed DHT record).

A client times the hops of its decode steps (:mod:`p2pserve.client.trust.observer`) and publishes,
every ``ClientConfig.report_period_s``, one record of kind ``RecordKind.REPORTS`` under its own
owner subkey. The coordinator compares these observations with what peers claim
(:mod:`p2pserve.coordinator.claims`).

What one :class:`ObservedRate` means: over the reporter's last ``samples`` one-token decode
Forwards to ``peer_id`` while it served ``layers`` layers, ``wall_rate`` is 1 / the median round
trip (tokens/s of one session, wire included: no peer can make it read higher than it serves),
and ``rate`` is 1 / (the median round trip minus the link RTT the client measured on the
OpenSession round trip): the peer's own per-session service rate. Both are *one session's*
rates; a peer's claimed throughput assumes a batch of sessions, which the coordinator accounts
for (``CoordinatorConfig.claim_batch``).
"""

from __future__ import annotations

import msgspec

from p2pserve.dht.records import (
    MAX_ADDRS,
    MAX_LAYERS,
    MAX_TOKENS_PER_S,
    SCHEMA_VERSION,
    _check_schema,
    _finite,
    _int,
    _str,
)
from p2pserve.dht.receipts import RECEIPT_BYTES
from p2pserve.errors import RecordRejected
from p2pserve.types import PeerId

MAX_REPORTED_PEERS = 1024  # peers one record may report on
MAX_SAMPLES = 1 << 30


class ObservedRate(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """One peer as one client saw it (see the module docstring for the definitions)."""

    peer_id: PeerId
    layers: int  # layers of the span the client used on this peer
    samples: int  # decode round trips behind the figures
    rate: float  # tokens/s of one session, the measured link RTT taken out
    wall_rate: float  # tokens/s of one session, round trip as measured
    observed_at: float = 0.0  # DHT time of the newest sample
    # the peer's signed receipt for the reporter (dht/receipts.py): without a valid one the
    # coordinator ignores this entry (its own compute probes need none)
    receipt: bytes = b""


class ServiceReports(msgspec.Struct, kw_only=True, frozen=True):
    """A client's observations of the peers it used recently.

    ``reporter_id`` is the reporter's own peer id (the author: readers reject records whose
    ``reporter_id`` is not the signer's id); ``addrs`` are the reporter's addresses as it sees
    them (self-announced: the coordinator counts one reporter per address, which only stops
    Sybil reporters that do not lie about their address).
    """

    schema: int = SCHEMA_VERSION
    model: str
    reporter_id: str
    addrs: list[str] = []
    rates: list[ObservedRate] = []
    timestamp: float = 0.0

    def validate(self) -> None:
        """Raise :class:`RecordRejected` on absurd figures, duplicates or oversized lists."""
        _check_schema(self.schema)
        _str("model", self.model)
        _str("reporter_id", self.reporter_id)
        if len(self.addrs) > MAX_ADDRS:
            raise RecordRejected(f"{len(self.addrs)} addrs, at most {MAX_ADDRS}")
        for a in self.addrs:
            _str("addr", a)
        if len(self.rates) > MAX_REPORTED_PEERS:
            raise RecordRejected(f"{len(self.rates)} reported peers, at most {MAX_REPORTED_PEERS}")
        seen: set[str] = set()
        for r in self.rates:
            _str("reported peer id", r.peer_id)
            if r.peer_id == self.reporter_id:
                raise RecordRejected("a report on the reporter itself")
            if r.peer_id in seen:
                raise RecordRejected(f"peer {r.peer_id} reported twice")
            seen.add(r.peer_id)
            _int(f"layers of {r.peer_id}", r.layers, 1, MAX_LAYERS)
            _int(f"samples of {r.peer_id}", r.samples, 1, MAX_SAMPLES)
            _finite(f"rate of {r.peer_id}", r.rate, 0.0, MAX_TOKENS_PER_S)
            _finite(f"wall_rate of {r.peer_id}", r.wall_rate, 0.0, MAX_TOKENS_PER_S)
            if r.wall_rate > r.rate * (1 + 1e-9):
                raise RecordRejected(f"wall_rate of {r.peer_id} above its RTT-corrected rate")
            _finite(f"observed_at of {r.peer_id}", r.observed_at, 0.0, 1e11)
            if len(r.receipt) > RECEIPT_BYTES:
                raise RecordRejected(f"receipt of {r.peer_id}: {len(r.receipt)} bytes, at most {RECEIPT_BYTES}")
        _finite("timestamp", self.timestamp, 0.0, 1e11)
