"""Which signed DHT records a reader accepts: identity binding, time bounds, the allow-list.

Pure rules over a decoded record, the peer id of the key that signed it (derived from the key
by :func:`p2pserve.dht.identity.peer_id_of`) and the reader's clock. Each returns ``None`` to
accept or a reason to log. :class:`p2pserve.dht.swarm.Swarm` applies them to every entry it
reads; :class:`p2pserve.testing.FakeSwarm` applies the identity and allow-list rules to its
named fakes.

* **Identity.** A record *about* peer X (a ``peer_id`` or ``reporter_id`` field) must be signed
  by X's key. A ``coordinator_id`` / ``leader_id`` may be a free name an operator chose
  (``--coordinator-id``); when it is shaped like a peer id, it must be the signer's.
* **Time.** A DHT expiration later than ``now + TTL(kind) + max_clock_skew``, or a timestamp
  (``timestamp``, ``created_at``, ``start_time``, ``measured_at``, ``observed_at``: on the
  record or on the structs it holds) later than ``now + max_clock_skew``, is a lie or a broken clock.
* **Membership.** With an allow-list, records of kinds members write about themselves (peers,
  links, reports, evidence) are accepted only from listed peer ids.
* **Bucket.** A link record read from a bucket key (:func:`p2pserve.dht.keys.link_bucket`) must
  be in its signer's bucket, so no writer can fill another bucket.
"""

from __future__ import annotations

from typing import Iterable, Optional

import msgspec

from p2pserve.dht.identity import looks_like_peer_id
from p2pserve.dht.keys import link_bucket
from p2pserve.errors import ConfigError
from p2pserve.types import PeerId

#: fields naming the peer a record is about or by: they must be the signer's own peer id
BOUND_ID_FIELDS = ("peer_id", "reporter_id", "machine_id")
#: ids that may be a free name; when shaped like a peer id, it must be the signer's
NAMED_ID_FIELDS = ("coordinator_id", "leader_id")
#: self-reported times, in DHT (wall clock) seconds
TIME_FIELDS = frozenset({"timestamp", "created_at", "start_time", "measured_at", "observed_at"})
#: record kinds (``RecordKind`` values) a member writes about itself: subject to the allow-list
MEMBER_KINDS = frozenset({"peers", "links", "reports", "evidence", "machines"})


def _short(peer_id: PeerId) -> str:
    return peer_id if len(peer_id) <= 16 else f"...{peer_id[-12:]}"


def identity_reason(record: object, signer_peer_id: str) -> Optional[str]:
    """Why ``record`` may not be signed by the key whose peer id is ``signer_peer_id`` (None: it may)."""
    for name in BOUND_ID_FIELDS:
        claimed = getattr(record, name, None)
        if claimed is not None and claimed != signer_peer_id:
            return f"{name} {_short(str(claimed))} is not the signer's peer id {_short(signer_peer_id)}"
    for name in NAMED_ID_FIELDS:
        claimed = getattr(record, name, None)
        if claimed != signer_peer_id and looks_like_peer_id(claimed):
            return f"{name} {_short(claimed)} is another peer's id (the signer is {_short(signer_peer_id)})"
    return None


def expiration_reason(expiration: float, now: float, ttl: float, max_clock_skew: float) -> Optional[str]:
    """Why a DHT expiration is not credible: later than a writer with a clock ``max_clock_skew``
    ahead could have set for a record living ``ttl`` (NaN included)."""
    if not expiration <= now + ttl + max_clock_skew:
        return f"expires {expiration - now:.0f} s from now, beyond its TTL {ttl:g} s + clock skew {max_clock_skew:g} s"
    return None


def _late_time(struct: msgspec.Struct, limit: float) -> Optional[tuple[str, float]]:
    for name in TIME_FIELDS.intersection(struct.__struct_fields__):
        value = getattr(struct, name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not value <= limit:
            return name, value
    return None


def _held_structs(record: msgspec.Struct) -> Iterable[msgspec.Struct]:
    """The structs ``record``'s list and dict fields hold, one level down, skipping containers
    whose struct type has no time field (a plan's flows: up to 10^5 of them)."""
    for name in record.__struct_fields__:
        value = getattr(record, name)
        items = list(value.values()) if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
        if items and isinstance(items[0], msgspec.Struct) and TIME_FIELDS.intersection(items[0].__struct_fields__):
            yield from (x for x in items if isinstance(x, msgspec.Struct))


def timestamp_reason(record: object, now: float, max_clock_skew: float) -> Optional[str]:
    """Why a record's self-reported times are not credible: any of them in the future by more
    than the tolerated clock skew."""
    if not isinstance(record, msgspec.Struct):
        return None
    limit = now + max_clock_skew
    for struct in (record, *_held_structs(record)):
        late = _late_time(struct, limit)
        if late is not None:
            return f"{late[0]} {late[1] - now:.0f} s in the future, beyond the clock skew {max_clock_skew:g} s"
    return None


def membership_reason(kind: str, signer_peer_id: str, allowed: frozenset[str]) -> Optional[str]:
    """Why a member record of ``kind`` from ``signer_peer_id`` is not admitted (empty ``allowed``
    admits everyone: an open swarm)."""
    if allowed and kind in MEMBER_KINDS and signer_peer_id not in allowed:
        return f"peer {_short(signer_peer_id)} is not in allowed_peers"
    return None


def allowed_set(peer_ids: Iterable[str]) -> frozenset[str]:
    """A configured allow-list as a set, ``ConfigError`` on an entry that is no peer id."""
    out = frozenset(p.strip() for p in peer_ids)
    bad = sorted(p for p in out if not looks_like_peer_id(p))
    if bad:
        raise ConfigError(f"allowed_peers holds {bad[0]!r}, which is not a libp2p peer id")
    return out


def bucket_reason(signer_id: PeerId, bucket: Optional[int]) -> Optional[str]:
    """A record read from link bucket ``bucket`` (None: not a bucket key) must be its signer's."""
    if bucket is None or link_bucket(signer_id) == bucket:
        return None
    return f"record in link bucket {bucket}, not its signer's ({link_bucket(signer_id)})"
