"""Publishing and reading a chunked plan (:mod:`p2pserve.dht.plan_chunks`) on the DHT.

This is how :meth:`Swarm.publish_plan <p2pserve.dht.swarm.Swarm.publish_plan>` and
:meth:`Swarm.get_plans <p2pserve.dht.swarm.Swarm.get_plans>` move a :class:`Plan`: the roles
still hand over and receive one ``Plan``; on the DHT it is an index and chunks that each fit a
value's safe size, whatever the swarm's size.

Keys: the index under ``<swarm>/<model>/plan-index`` (one entry per coordinator, under its
owner subkey, like every record), each chunk under ``<swarm>/<model>/plan-chunk/<name>@<epoch>``
(the epoch of its content, so a chunk an index still references after a delta stays where it
was). Readers accept an index only as they would accept a plan: signed by a trusted coordinator
(in an open swarm, by the elected candidate under its coordinator id), with an expiration its TTL
allows and an epoch time allows; each chunk from the same signer as the index, checked against
the digest the index names (:func:`plan_chunks.assemble`); and the assembled plan passes the
same identity and timestamp rules as any record.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Mapping, Optional, Protocol, Sequence

from p2pserve.config import DHTConfig
from p2pserve.dht import keys
from p2pserve.dht.acceptance import expiration_reason, identity_reason, membership_reason, timestamp_reason
from p2pserve.dht.election import SignedPlan, epoch_ceiling, is_elected
from p2pserve.dht.identity import peer_id_of
from p2pserve.dht.plan_chunks import (
    CHUNK_LIMIT_BYTES, PlanChunk, PlanIndex, assemble, decode_chunk, decode_index, delta, encode, flow_groups,
    route_chunks, split_plan,
)
from p2pserve.dht.records import CoordinatorCandidate, Plan
from p2pserve.dht.signing import is_trusted, normalize_public_key
from p2pserve.errors import ConfigError, MalformedFrameError, RecordRejected

class Rejects(Protocol):
    """Where a reader logs what it refused."""

    def reject(self, kind: str, signer: Optional[str], reason: str) -> None:
        """Record one rejection."""
        ...


class Swarm(Protocol):
    """What this module needs of :class:`p2pserve.dht.swarm.Swarm` (which calls it)."""

    config: DHTConfig
    rejects: Rejects

    async def store_owned(self, key: str, value: bytes, ttl: float) -> bool:
        """Store ``value`` under this node's subkey of ``key``."""
        ...

    async def fetch_owned(self, key: str) -> list[tuple[str, bytes, float]]:
        """Live ``(signer, value, expiration)`` entries under ``key``."""
        ...


def index_key(swarm: Swarm) -> str:
    """Where the plan indexes of this swarm and model live."""
    return f"{keys.check_name(swarm.config.swarm_id, 'swarm id')}/{keys.model_slug(swarm.config.model)}/plan-index"


def chunk_key(swarm: Swarm, name: str, epoch: int) -> str:
    """Where chunk ``name`` made in ``epoch`` lives."""
    return f"{index_key(swarm)[:-len('plan-index')]}plan-chunk/{keys.check_name(name, 'chunk name')}@{epoch}"


async def publish_chunked(swarm: Swarm, index: PlanIndex, chunks: Sequence[PlanChunk]) -> bool:
    """Store ``chunks`` (the ones a delta says are new), then the index naming them."""
    ttl = swarm.config.plan_ttl
    stores = []
    for chunk in chunks:
        chunk.validate()
        stores.append(swarm.store_owned(chunk_key(swarm, chunk.name, chunk.epoch), encode(chunk), ttl))
    ok = all(await asyncio.gather(*stores))
    index.validate()
    data = encode(index)
    if len(data) > CHUNK_LIMIT_BYTES:
        raise RecordRejected(f"plan index of {len(data)} bytes exceeds {CHUNK_LIMIT_BYTES}")
    return ok and await swarm.store_owned(index_key(swarm), data, ttl)


@dataclass
class PlanPublisher:
    """A coordinator's side: each plan as a delta against the last one it published.

    A new epoch stores the chunks whose content changed; the chunks it still references from
    earlier epochs are stored again once half of ``plan_refresh`` passed since their last store,
    so none expires while an index names it. Refreshing the same epoch stores them all.
    """

    last: Optional[PlanIndex] = None
    stored: dict[tuple[str, int], tuple[PlanChunk, float]] = field(default_factory=dict)

    async def publish(self, swarm: Swarm, plan: Plan, now: float,
                      group_of: Optional[Mapping[str, str]] = None) -> bool:
        """Store ``plan`` as an index and chunks, one group per cell (``Plan.cells``), else per
        ``group_of``, else per connected part of the flows."""
        if group_of is None:
            group_of = plan.cells or flow_groups(plan)
        index, chunks = split_plan(plan, group_of)
        # a delta only against an older epoch (a coordinator that restarted may publish lower)
        older = self.last if self.last is not None and self.last.epoch < index.epoch else None
        index, fresh = delta(older, index, chunks)
        fresh_keys = {(c.name, c.epoch) for c in fresh}
        refs = {(r.name, r.epoch) for r in index.chunks}
        # half a refresh period: the next publish may come a whole period later, and a chunk
        # must still be alive then (its TTL is about two periods)
        due = [entry[0] for k, entry in self.stored.items()
               if k in refs and k not in fresh_keys and now - entry[1] >= swarm.config.plan_refresh / 2]
        ok = await publish_chunked(swarm, index, [*fresh, *due])
        self.stored = {k: v for k, v in self.stored.items() if k in refs}
        for c in [*fresh, *due]:
            self.stored[(c.name, c.epoch)] = (c, now)
        self.last = index
        return ok


@dataclass(frozen=True)
class PlanReadRules:
    """What a reader checks an index against: the trusted coordinators (empty: an open swarm,
    where only the elected candidate is followed), the allowed peers, and the model's depth."""

    trusted: frozenset
    allowed: frozenset
    num_layers: Optional[int]


async def read_plans(swarm: Swarm, rules: PlanReadRules, now: float,
                     candidates: Callable[[], Awaitable[Sequence[CoordinatorCandidate]]],
                     group: Optional[str] = None) -> list[tuple[SignedPlan, float]]:
    """Every index a reader may follow, assembled with its chunks into a plan: ``(plan, the
    index's expiration)`` each. ``group``: None reads every chunk; a group's name reads only
    that group's chunks, and ``""`` those of the group taking the most flow from clients
    (:func:`plan_chunks.route_chunks`): what one route needs."""
    cfg = swarm.config
    indexes: list[tuple[str, PlanIndex, float]] = []
    for signer, value, expiration in await swarm.fetch_owned(index_key(swarm)):
        try:
            index = _accept_index(swarm, rules, signer, value, expiration, now)
        except (MalformedFrameError, RecordRejected) as e:
            swarm.rejects.reject("plan", signer, str(e))
            continue
        if index is not None:
            indexes.append((signer, index, expiration))
    if not rules.trusted and indexes:  # an open swarm: anyone may sign a plan, only the leader is followed
        cands = list(await candidates())
        indexes = [x for x in indexes if is_elected(x[1].leader_id, x[0], cands, normalize_public_key)]
    out = []
    for signer, index, expiration in indexes:
        try:
            plan = await _assemble(swarm, signer, index, group)
            reason = (identity_reason(plan, peer_id_of(signer))
                      or timestamp_reason(plan, now, cfg.max_clock_skew))
            if reason is not None:
                raise RecordRejected(reason)
        except (MalformedFrameError, RecordRejected, ConfigError) as e:
            swarm.rejects.reject("plan", signer, str(e))
            continue
        out.append((SignedPlan(plan, signer), expiration))
    return out


def _accept_index(swarm: Swarm, rules: PlanReadRules, signer: str, value: bytes, expiration: float,
                  now: float) -> Optional[PlanIndex]:
    """The index if this reader may follow it; None for another model; raises with the reason."""
    cfg = swarm.config
    if not is_trusted(signer, rules.trusted):
        raise RecordRejected("plan signed by a key not in trusted_coordinators")
    try:
        signer_id = peer_id_of(signer)
    except ConfigError as e:
        raise RecordRejected(f"owner key gives no peer id: {e}") from e
    reason = (expiration_reason(expiration, now, cfg.ttl(keys.RecordKind.PLAN), cfg.max_clock_skew)
              or membership_reason("plan", signer_id, rules.allowed))
    if reason is not None:
        raise RecordRejected(reason)
    index = decode_index(value)
    if index.model != cfg.model:
        return None
    if rules.num_layers is not None and index.num_layers != rules.num_layers:
        raise RecordRejected(f"plan for {index.num_layers} layers; this model has {rules.num_layers}")
    ceiling = epoch_ceiling(now + cfg.max_clock_skew)
    if index.epoch > ceiling:
        raise RecordRejected(f"epoch {index.epoch} beyond what time allows ({ceiling})")
    return index


async def _assemble(swarm: Swarm, signer: str, index: PlanIndex, group: Optional[str]) -> Plan:
    """The index's chunks (all, or one group's), fetched at once, from ``signer`` only."""
    refs = {r.name: r for r in index.chunks}
    names = list(refs) if group is None else route_chunks(index, group)
    found = await asyncio.gather(*(swarm.fetch_owned(chunk_key(swarm, n, refs[n].epoch)) for n in names))
    chunks: dict[str, PlanChunk] = {}
    for name, entries in zip(names, found):
        for who, value, _exp in entries:
            if who == signer:
                chunks[name] = decode_chunk(value)
        if name not in chunks and group is None:
            raise RecordRejected(f"chunk {name!r} of epoch {index.epoch} not found")
    return assemble(index, chunks)
