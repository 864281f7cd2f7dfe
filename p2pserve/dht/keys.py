"""DHT key schema.

Every key is ``"<swarm>/<model>/<kind>"``: the swarm id and the model come first so that two
swarms (or two models in one swarm) sharing a DHT never read each other's records. Each kind
is one DHT *dictionary* key whose subkeys are owned by the signer of the record stored there
(see :mod:`p2pserve.dht.signing`), so one peer / coordinator owns exactly one entry per kind.

Link records are the exception in layout: a peer's ``LinkInfo`` goes under one of
:data:`LINK_BUCKETS` keys ``"<swarm>/<model>/links/<bucket>"``, the bucket a hash of its peer id
(:func:`link_bucket`), so no single value holds every peer's links (about 5 kB per peer with
bounded probing: 5 MB at a thousand peers, past hivemind's 4 MiB message) and a reader fetches the
buckets in parallel.

Pure string functions; no hivemind import.
"""

from __future__ import annotations

import hashlib
import re
from enum import Enum

from p2pserve.errors import ConfigError

# Swarm ids and model names become part of DHT keys; keep them printable and separator-free so
# that "a/b" + "c" can never collide with "a" + "b/c".
_NAME_RE = re.compile(r"^[A-Za-z0-9._:@+=-]{1,128}$")


class RecordKind(str, Enum):
    """The record kinds stored in the DHT (one dictionary key each per swarm+model)."""

    PEERS = "peers"
    LINKS = "links"
    COORDINATORS = "coordinators"
    PLAN = "plan"
    REPORTS = "reports"  # service rates clients observed at peers (p2pserve.dht.reports)
    EVIDENCE = "evidence"  # signed proof that a peer's output differed from a replica's (p2pserve.dht.evidence)
    MACHINES = "machines"  # a machine agent's slots and the links between them (p2pserve.dht.machine_info)


def check_name(value: str, what: str) -> str:
    """Return ``value`` if it is a valid swarm id / model name, else raise ``ConfigError``."""
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ConfigError(
            f"invalid {what} {value!r}: use 1-128 characters from letters, digits and ._:@+=- "
            "(no '/', it separates key parts)"
        )
    return value


def model_slug(model: str) -> str:
    """Turn a model name or Hugging Face repo id into a key-safe name ("org/name" -> "org--name")."""
    slug = model.strip().replace("/", "--")
    return check_name(slug, "model name")


def record_key(swarm: str, model: str, kind: RecordKind | str) -> str:
    """The DHT key holding all records of ``kind`` for ``model`` in ``swarm``."""
    kind = RecordKind(kind)
    return f"{check_name(swarm, 'swarm id')}/{model_slug(model)}/{kind.value}"


#: Keys link records are spread over (a protocol constant: every peer must agree on it). At a
#: thousand peers a bucket holds about 60 records, 0.3 MB.
LINK_BUCKETS = 16


def link_bucket(peer_id: str, buckets: int = LINK_BUCKETS) -> int:
    """The bucket of ``peer_id``'s link record: a hash of the id, so every reader agrees."""
    return int.from_bytes(hashlib.blake2b(peer_id.encode(), digest_size=8).digest(), "big") % buckets


def link_keys(swarm: str, model: str, buckets: int = LINK_BUCKETS) -> list[str]:
    """The DHT keys of every link bucket, bucket ``b`` at position ``b``."""
    base = record_key(swarm, model, RecordKind.LINKS)
    return [f"{base}/{b}" for b in range(buckets)]


def read_keys(swarm: str, model: str, kind: RecordKind | str) -> list[tuple[str, int | None]]:
    """The keys a reader of ``kind`` fetches, each with its link bucket (None: the kind's own key,
    the only one of every kind but links)."""
    own: list[tuple[str, int | None]] = [(record_key(swarm, model, kind), None)]
    if RecordKind(kind) is not RecordKind.LINKS:
        return own
    return own + [(k, b) for b, k in enumerate(link_keys(swarm, model))]


def write_key(swarm: str, model: str, kind: RecordKind | str, peer_id: str) -> str:
    """The key ``peer_id`` stores its record of ``kind`` under (links: its bucket's)."""
    if RecordKind(kind) is RecordKind.LINKS:
        return link_keys(swarm, model)[link_bucket(peer_id)]
    return record_key(swarm, model, kind)


def parse_key(key: str) -> tuple[str, str, RecordKind]:
    """Inverse of :func:`record_key`: ``(swarm, model_slug, kind)``; ``ConfigError`` if malformed."""
    parts = key.split("/")
    if len(parts) != 3:
        raise ConfigError(f"not a p2pserve DHT key: {key!r}")
    swarm, slug, kind = parts
    try:
        return check_name(swarm, "swarm id"), check_name(slug, "model name"), RecordKind(kind)
    except ValueError as e:
        raise ConfigError(f"not a p2pserve DHT key: {key!r}") from e
