"""``Swarm``: the thin async shell over ``hivemind.DHT`` for one swarm + model.

Writes go under this node's owner subkey (signed by the DHT's validator); reads decode every
entry into a typed record, validate it and drop what fails with a logged reason. All policy
(who leads, which plan wins, what a record may contain) lives in the pure modules
:mod:`records`, :mod:`election`, :mod:`signing`, :mod:`acceptance` (which records a reader
accepts: identity binding, time bounds, allow-list); this file only moves bytes.

Typical use (a peer)::

    swarm = await Swarm.create(DHTConfig(model="llama", initial_peers=(...,)))
    await swarm.announce_peer(PeerInfo(model=..., peer_id=swarm.peer_id, ...))
    plan = await swarm.get_plan()          # SignedPlan | None
    await swarm.withdraw_all(); swarm.shutdown()
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Optional

import hivemind

from p2pserve import clock as clocks
from p2pserve.clock import Clock
from p2pserve.config import DHTConfig
from p2pserve.dht import keys
from p2pserve.dht.acceptance import (
    allowed_set,
    bucket_reason,
    expiration_reason,
    identity_reason,
    membership_reason,
    timestamp_reason,
)
from p2pserve.dht.election import SignedPlan, choose_plan
from p2pserve.dht.evidence import derive_reply_key
from p2pserve.dht.identity import node_key, peer_id_of
from p2pserve.dht.node import start_dht
from p2pserve.dht.plan_store import PlanPublisher, PlanReadRules, read_plans
from p2pserve.dht.records import (
    CoordinatorCandidate,
    LinkInfo,
    PeerInfo,
    Plan,
    RecordRejected,
    decode_record,
    encode_record,
)
from p2pserve.dht.signing import (
    is_trusted,
    normalize_public_key,
    owner_of_subkey,
    owner_subkey,
    public_key_text,
    trusted_set,
)
from p2pserve.dht.view import Signed
from p2pserve.errors import ConfigError, MalformedFrameError

logger = logging.getLogger(__name__)

TOMBSTONE = b""  # what withdraw() stores: an empty value, ignored by readers


class RejectLog:
    """Logs each (signer, reason) rejection at most once per ``interval`` seconds."""

    def __init__(self, interval: float, clock: Clock = clocks.monotonic):
        self._interval = interval
        self._clock = clock
        self._last: dict[tuple[str, str], float] = {}
        self.count = 0  # total rejections seen, for tests and status

    def reject(self, kind: str, signer: Optional[str], reason: str) -> None:
        """Record one rejection; logs a WARNING unless the same one was logged recently."""
        self.count += 1
        who = f"...{signer[-12:]}" if signer else "<no owner>"
        now = self._clock()
        k = (f"{kind}:{signer}", reason)
        if now - self._last.get(k, -1e18) >= self._interval:
            if len(self._last) > 10_000:
                self._last.clear()
            self._last[k] = now
            logger.warning(f"ignored {kind} record signed by {who}: {reason}")


class Swarm:
    """One node's handle on the records of one model in one swarm: the hivemind implementation
    of :class:`~p2pserve.dht.view.SwarmView`.

    ``__init__`` does no I/O; use :meth:`create` to start a DHT node, or pass an existing one.
    ``clock`` is DHT time (:func:`p2pserve.clock.wall`): record timestamps and expirations.
    """

    def __init__(
        self,
        config: DHTConfig,
        dht: hivemind.DHT,
        private_key,
        *,
        clock: Clock = clocks.wall,
    ):
        self.config = config
        self.dht = dht
        self._key = private_key
        self._subkey = owner_subkey(private_key)
        self.public_key = public_key_text(private_key)
        self._peer_id = peer_id_of(self.public_key)
        self._clock = clock
        self._trusted = trusted_set(config.trusted_coordinators)
        self._allowed = allowed_set(config.allowed_peers)
        self._last_expiration: dict[keys.RecordKind, float] = {}
        self.rejects = RejectLog(config.reject_log_interval)
        self._last_plan: Optional[tuple[SignedPlan, float]] = None  # (plan, its record's expiration)
        self._plan_expiration: dict[str, float] = {}
        self._owned_expiration: dict[str, float] = {}
        self._plans_out = PlanPublisher()  # what this node published as chunks, for deltas
        # signers whose entry of a kind was a tombstone at the last read (they left on purpose)
        self.withdrawn: dict[keys.RecordKind, set[str]] = {kind: set() for kind in keys.RecordKind}
        self._keys = {kind: keys.record_key(config.swarm_id, config.model, kind) for kind in keys.RecordKind}
        # link records go to a bucket key by a hash of the peer id (keys.link_bucket)
        self._keys_out = {kind: keys.write_key(config.swarm_id, config.model, kind, self._peer_id)
                          for kind in keys.RecordKind}

    # ----------------------------------------------------------------------------- lifecycle

    @staticmethod
    def start_dht(config: DHTConfig, private_key) -> hivemind.DHT:
        """Start a hivemind DHT node for ``config`` with our signature validator (blocks ~1-3 s);
        ``private_key`` is its libp2p identity (the key in ``config.identity_path``, if set)."""
        return start_dht(initial_peers=config.initial_peers, host_maddrs=config.host_maddrs, private_key=private_key,
                         announce_maddrs=config.announce_maddrs, identity_path=config.identity_path,
                         use_relay=config.use_relay, use_auto_relay=config.use_auto_relay,
                         client_mode=config.client_mode,
                         key_dir=os.path.dirname(os.path.abspath(config.key_path)) if config.key_path else None)

    @classmethod
    def create(cls, config: DHTConfig, *, clock: Clock = clocks.wall) -> "Swarm":
        """Load (or create) the node's key (``key_path`` / ``identity_path``, see
        :func:`~p2pserve.dht.identity.node_key`) and start a DHT node for ``config`` whose libp2p
        identity it is."""
        key = node_key(config.key_path, config.identity_path)
        return cls(config, cls.start_dht(config, key), key, clock=clock)

    @property
    def peer_id(self) -> str:
        """This node's libp2p peer id (base58), derived from its key (the DHT node runs as it)."""
        return self._peer_id

    def reply_key(self):
        """The Ed25519 key this node's peer signs its replies with: derived from the node's identity,
        so that it is the same across restarts (``dht.evidence.derive_reply_key``)."""
        return derive_reply_key(self._key.to_bytes())

    def visible_maddrs(self) -> list[str]:
        """Multiaddrs others can use as ``--initial-peers`` to reach this node."""
        return [str(a) for a in self.dht.get_visible_maddrs()]

    async def replicate_p2p(self):
        """A handle on this node's libp2p daemon (for the probe and session protocols)."""
        return await self.dht.replicate_p2p()

    def shutdown(self) -> None:
        """Stop the DHT node (records stay until they expire unless withdrawn first)."""
        self.dht.shutdown()

    # ----------------------------------------------------------------------------- writes

    async def _put(self, kind: keys.RecordKind, value: bytes, ttl: float) -> bool:
        # hivemind keeps the entry with the later expiration, so each write must expire later
        # than the previous one (a refresh does by construction; a withdraw must take care)
        expiration = max(self._clock() + ttl, self._last_expiration.get(kind, 0.0) + 1e-3)
        self._last_expiration[kind] = expiration
        fut = self.dht.store(
            self._keys_out[kind], value, expiration_time=expiration, subkey=self._subkey, return_future=True
        )
        return bool(await asyncio.wait_for(asyncio.wrap_future(fut), self.config.rpc_timeout))

    async def store_owned(self, key: str, value: bytes, ttl: float) -> bool:
        """Store ``value`` under our subkey of an arbitrary ``key`` (:mod:`p2pserve.dht.plan_store`)."""
        # later than this key's previous store, as in _put (hivemind keeps the later expiration)
        expiration = max(self._clock() + ttl, self._owned_expiration.get(key, 0.0) + 1e-3)
        if len(self._owned_expiration) > 4096:
            self._owned_expiration.clear()
        self._owned_expiration[key] = expiration
        fut = self.dht.store(key, value, expiration_time=expiration, subkey=self._subkey, return_future=True)
        return bool(await asyncio.wait_for(asyncio.wrap_future(fut), self.config.rpc_timeout))

    async def fetch_owned(self, key: str) -> list[tuple[str, bytes, float]]:
        """Live ``(signer, value, expiration)`` entries under ``key``, unvalidated bytes (the
        caller decodes and validates them); entries without an owner are dropped."""
        fut = self.dht.get(key, latest=True, return_future=True)
        found = await asyncio.wait_for(asyncio.wrap_future(fut), self.config.rpc_timeout)
        if found is None or not isinstance(found.value, dict):
            return []
        now = self._clock()
        return [(signer, bytes(item.value), item.expiration_time) for subkey, item in found.value.items()
                if (signer := owner_of_subkey(subkey)) is not None and item.expiration_time >= now
                and isinstance(item.value, (bytes, bytearray)) and item.value]

    def _check_own(self, record) -> None:
        """Validate a record before publishing it, and refuse one readers would drop as not ours."""
        record.validate()
        reason = identity_reason(record, self.peer_id)
        if reason is not None:
            raise ConfigError(f"refusing to publish a record readers would reject: {reason}")

    async def announce_peer(self, info: PeerInfo) -> bool:
        """Store (or refresh) this node's PeerInfo; validated first so we never publish junk."""
        self._check_own(info)
        return await self._put(keys.RecordKind.PEERS, encode_record(info), self.config.peer_ttl)

    async def announce_links(self, info: LinkInfo) -> bool:
        """Store (or refresh) this node's LinkInfo."""
        self._check_own(info)
        return await self._put(keys.RecordKind.LINKS, encode_record(info), self.config.link_ttl)

    async def announce_candidate(self, cand: CoordinatorCandidate) -> bool:
        """Store (or refresh) this coordinator's candidacy."""
        self._check_own(cand)
        if normalize_public_key(cand.public_key) != normalize_public_key(self.public_key):
            raise ConfigError("a candidacy must carry this node's own public key")
        return await self._put(keys.RecordKind.COORDINATORS, encode_record(cand), self.config.candidate_ttl)

    async def publish_plan(self, plan: Plan) -> bool:
        """Store (or refresh) the plan this coordinator leads with: as an index and chunks that
        each fit a DHT value, only the chunks that changed since the last epoch
        (:mod:`~p2pserve.dht.plan_store`)."""
        self._check_own(plan)
        return await self._plans_out.publish(self, plan, self._clock())

    async def announce(self, kind: keys.RecordKind, record, ttl: Optional[float] = None) -> bool:
        """Store (or refresh) this node's record of another ``kind`` (reports, evidence): it is
        validated first; ``ttl`` defaults to the peer records' TTL and is at most the kind's
        (``DHTConfig.ttl``: readers reject later expirations)."""
        self._check_own(record)
        limit = self.config.ttl(kind)
        return await self._put(kind, encode_record(record), min(self.config.peer_ttl if ttl is None else ttl, limit))

    async def withdraw(self, kind: keys.RecordKind) -> bool:
        """Replace this node's entry of ``kind`` by a short-lived tombstone."""
        if kind not in self._last_expiration:
            return True  # never announced
        return await self._put(kind, TOMBSTONE, self.config.max_clock_skew + 1.0)

    async def withdraw_all(self) -> None:
        """Withdraw everything this node announced (called on shutdown)."""
        for kind in list(self._last_expiration):
            try:
                await self.withdraw(kind)
            except (asyncio.TimeoutError, OSError) as e:  # shutting down anyway; records will expire
                logger.info(f"withdraw {kind.value} failed ({e!r}); it will expire on its own")

    # ----------------------------------------------------------------------------- reads

    async def _get(self, key: str):
        """The raw value under ``key`` (hivemind's), or None."""
        fut = self.dht.get(key, latest=True, return_future=True)
        return await asyncio.wait_for(asyncio.wrap_future(fut), self.config.rpc_timeout)

    async def _entries(self, kind: keys.RecordKind, cls: type) -> list[Signed]:
        # links: the kind's key and every bucket, fetched at once; bucket b holds only the records
        # of signers whose peer id hashes to b (one bounded value per bucket, whoever writes)
        names, buckets = zip(*keys.read_keys(self.config.swarm_id, self.config.model, kind))
        found = await asyncio.gather(*(self._get(k) for k in names))
        now = self._clock()
        out = []
        withdrawn = set()
        for bucket, got in zip(buckets, found):
            if got is None:
                continue
            if not isinstance(got.value, dict):
                self.rejects.reject(kind.value, None, "key holds a plain value, expected owner subkeys")
                continue
            for subkey, item in got.value.items():
                signer = owner_of_subkey(subkey)
                if signer is None:
                    self.rejects.reject(kind.value, None, "subkey names no owner (unsigned record)")
                    continue
                if item.expiration_time < now:
                    continue
                if isinstance(item.value, (bytes, bytearray)) and len(item.value) == 0:
                    withdrawn.add(signer)  # tombstone: withdrawn (it can only withdraw its own signer)
                    continue
                try:
                    out.append(self._accept(kind, cls, signer, item.value, item.expiration_time, now, bucket))
                except (RecordRejected, MalformedFrameError) as e:
                    self.rejects.reject(kind.value, signer, str(e))
        self.withdrawn[kind] = withdrawn
        return out

    def _accept(self, kind: keys.RecordKind, cls: type, signer: str, value, expiration: float, now: float,
                bucket: Optional[int] = None) -> Signed:
        """One live entry (from link bucket ``bucket``, if one) as a ``Signed`` record, or
        ``RecordRejected`` / ``MalformedFrameError`` with the reason: the rules of
        :mod:`~p2pserve.dht.acceptance`, decoding and validation."""
        try:
            signer_id = peer_id_of(signer)
        except ConfigError as e:
            raise RecordRejected(f"owner key gives no peer id: {e}") from e
        reason = (expiration_reason(expiration, now, self.config.ttl(kind), self.config.max_clock_skew)
                  or membership_reason(kind.value, signer_id, self._allowed) or bucket_reason(signer_id, bucket))
        if reason is None:
            record = decode_record(value, cls, self.config.num_layers)
            if getattr(record, "model", self.config.model) != self.config.model:
                reason = f"record for model {record.model!r} under this model's key"
            else:
                reason = identity_reason(record, signer_id) or timestamp_reason(record, now, self.config.max_clock_skew)
        if reason is not None:
            raise RecordRejected(reason)
        return Signed(record, signer, expiration)

    async def read(self, kind: keys.RecordKind, cls: type) -> list[Signed]:
        """Every live, valid record of ``kind`` decoded as ``cls`` (its ``validate()`` run), with
        its signer: the read side of :meth:`announce`."""
        return await self._entries(kind, cls)

    async def get_peers(self) -> dict[str, Signed[PeerInfo]]:
        """Live, valid PeerInfo records by peer id, each signed by that peer's own key.

        One key can still hold two entries (subkeys differing in the key's comment): the one
        the DHT keeps longer wins, never the self-reported timestamp.
        """
        return self._by_peer_id("peers", await self._entries(keys.RecordKind.PEERS, PeerInfo))

    async def get_links(self) -> dict[str, Signed[LinkInfo]]:
        """Live, valid LinkInfo records by measuring peer id, each signed by that peer's key."""
        return self._by_peer_id("links", await self._entries(keys.RecordKind.LINKS, LinkInfo))

    def _by_peer_id(self, kind: str, signed: list[Signed]) -> dict[str, Signed]:
        out: dict[str, Signed] = {}
        for s in signed:
            pid = s.record.peer_id
            if pid in out:
                older, newer = sorted((out[pid], s), key=lambda x: x.expiration)
                self.rejects.reject(kind, older.signer, f"peer id {pid} has two entries; using the later expiring")
                out[pid] = newer
            else:
                out[pid] = s
        return out

    async def get_candidates(self) -> list[Signed[CoordinatorCandidate]]:
        """Live coordinator candidacies whose declared key is their signer's (trusted only, if set)."""
        out = []
        for s in await self._entries(keys.RecordKind.COORDINATORS, CoordinatorCandidate):
            try:
                same = normalize_public_key(s.record.public_key) == normalize_public_key(s.signer)
            except ConfigError:
                same = False
            if not same:
                self.rejects.reject("coordinators", s.signer, "declared public key is not the signer's")
                continue
            if not is_trusted(s.signer, self._trusted):
                self.rejects.reject("coordinators", s.signer, "coordinator key not in trusted_coordinators")
                continue
            out.append(s)
        return out

    async def get_plans(self) -> list[SignedPlan]:
        """All live plans signed by trusted coordinators (in an open swarm: by the elected
        candidate, ``election.elected_plans``), with epochs that time allows, each assembled
        from its index and chunks (:func:`~p2pserve.dht.plan_store.read_plans`)."""
        found = await self.read_plans()
        self._plan_expiration = {p.signer: expiration for p, expiration in found}
        return [p for p, _ in found]

    async def read_plans(self, group: Optional[str] = None) -> list[tuple[SignedPlan, float]]:
        """The plans :meth:`get_plans` follows with their expirations; ``group`` reads only one
        group's chunks (``""``: the group taking the most flow, what one route needs)."""
        rules = PlanReadRules(self._trusted, self._allowed, self.config.num_layers)
        return await read_plans(self, rules, self._clock(), self._candidate_records, group)

    async def _candidate_records(self) -> list[CoordinatorCandidate]:
        return [c.record for c in await self.get_candidates()]

    async def get_plan(self) -> Optional[SignedPlan]:
        """The plan to follow: highest epoch among trusted, valid plans (``None`` if none yet).

        The last plan stays valid: when a read finds no plan (the leader died and its record
        expired before the next leader published, or the read missed it), the last one seen is
        returned. A read that finds only lower epochs than the remembered plan is treated as a
        miss while the remembered record has not expired; after that the lower epoch is
        accepted, so that a swarm whose coordinators all restarted is followed again.
        """
        best = choose_plan(await self.get_plans())
        now = self._clock()
        if best is None:
            return self._last_plan[0] if self._last_plan else None
        if self._last_plan is not None:
            last, expiration = self._last_plan
            if last.plan.epoch > best.plan.epoch and expiration >= now:
                return last
        self._last_plan = (best, self._plan_expiration.get(best.signer, now))
        return best
