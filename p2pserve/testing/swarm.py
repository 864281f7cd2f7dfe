"""An in-memory swarm: the DHT records of several fake nodes, behind the real swarm protocol."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from typing import Callable, NamedTuple, Optional

from p2pserve.config import DHTConfig
from p2pserve.dht.acceptance import identity_reason, membership_reason
from p2pserve.dht.election import SignedPlan, choose_plan
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.records import CoordinatorCandidate, LinkInfo, PeerInfo, Plan, validate_for_model
from p2pserve.errors import ConfigError, RecordRejected
from p2pserve.dht.view import Signed

#: One entry of a :class:`FakeSwarmStore`: a record and its expiration time.
StoredRecord = tuple[object, float]


class FakeSwarmStore:
    """The records of one in-memory swarm, shared by the :class:`FakeSwarm` nodes on it.

    ``records[kind][signer]`` is ``(record, expiration)``. Without a ``clock`` nothing expires;
    with one, a record expires ``ttl`` after its store, as in the DHT. Tests may :meth:`put`
    records directly (skipping validation, like a buggy or hostile member) or :meth:`drop` one
    (a crash: gone without a tombstone).
    """

    def __init__(self, clock: Optional[Callable[[], float]] = None):
        self.clock = clock
        self.records: dict[RecordKind, dict[str, StoredRecord]] = {kind: {} for kind in RecordKind}
        self.withdrawn: dict[RecordKind, set[str]] = {kind: set() for kind in RecordKind}

    def put(self, kind: RecordKind, signer: str, record: object, ttl: float = float("inf")) -> None:
        """Store ``record`` as ``signer``'s entry of ``kind``."""
        expiration = self.clock() + ttl if self.clock is not None else float("inf")
        self.records[kind][signer] = (record, expiration)
        self.withdrawn[kind].discard(signer)

    def drop(self, kind: RecordKind, signer: str) -> None:
        """Remove ``signer``'s entry of ``kind`` as if its record had expired."""
        self.records[kind].pop(signer, None)

    def withdraw(self, kind: RecordKind, signer: str) -> None:
        """Remove ``signer``'s entry of ``kind`` and mark it withdrawn (a tombstone)."""
        if self.records[kind].pop(signer, None) is not None:
            self.withdrawn[kind].add(signer)

    def get(self, kind: RecordKind, signer: str) -> Optional[object]:
        """``signer``'s live record of ``kind``, or None."""
        entry = self.live(kind).get(signer)
        return None if entry is None else entry[0]

    def live(self, kind: RecordKind) -> dict[str, StoredRecord]:
        """Unexpired entries of ``kind`` by signer."""
        now = self.clock() if self.clock is not None else None
        return {s: e for s, e in self.records[kind].items() if now is None or e[1] >= now}


def fake_peer_id(signer: str) -> str:
    """The peer id of a fake signer: ``"key-<name>"`` is node ``name``'s key; a signer a test
    put records under directly (``store.put(kind, "B", ...)``) is its own peer id."""
    return signer.removeprefix("key-")


class FakeSwarm:
    """An in-memory :class:`~p2pserve.dht.view.SwarmView`: one node of a :class:`FakeSwarmStore`.

    Several instances on one store are several nodes of one swarm (a read-only client view
    included). Records are validated on announce as the real ``Swarm`` does; reads return them
    as ``Signed`` / ``SignedPlan`` signed by ``"key-<name>"``. ``calls`` counts reads and
    writes by method, for tests of caching.

    Reads apply the real reader's identity and allow-list rules (:mod:`p2pserve.dht.acceptance`)
    to fake identities: the peer id of signer ``"key-<name>"`` is ``name`` (:func:`fake_peer_id`),
    so a record about another peer put under one's own signer is dropped, and listed in
    ``rejected`` with its reason. Conflicts by peer id go to the later expiration. Time bounds
    are not mimicked (fake clocks start anywhere).
    """

    def __init__(self, store: Optional[FakeSwarmStore] = None, name: str = "node",
                 config: Optional[DHTConfig] = None):
        self.store = store if store is not None else FakeSwarmStore()
        self.name = name
        self.config = config if config is not None else DHTConfig(model="m")
        self.peer_id = name
        self.public_key = "key-" + name
        self.calls: Counter[str] = Counter()
        self.rejected: list[tuple[str, str, str]] = []  # (kind, signer, reason) of dropped records

    @property
    def withdrawn(self) -> dict[RecordKind, set[str]]:
        """Signers whose entry of a kind was withdrawn (a tombstone), by kind."""
        return self.store.withdrawn

    def _put(self, kind: RecordKind, record, ttl: float) -> bool:
        self.calls[f"put_{kind.value}"] += 1
        record.validate()
        reason = identity_reason(record, self.peer_id)
        if reason is not None:  # as Swarm does: never publish what readers would drop
            raise ConfigError(f"refusing to publish a record readers would reject: {reason}")
        self.store.put(kind, self.public_key, record, ttl)
        return True

    async def announce_peer(self, info: PeerInfo) -> bool:
        """Store this node's PeerInfo."""
        return self._put(RecordKind.PEERS, info, self.config.peer_ttl)

    async def announce_links(self, info: LinkInfo) -> bool:
        """Store this node's LinkInfo."""
        return self._put(RecordKind.LINKS, info, self.config.link_ttl)

    async def announce_candidate(self, cand: CoordinatorCandidate) -> bool:
        """Store this node's candidacy."""
        return self._put(RecordKind.COORDINATORS, cand, self.config.candidate_ttl)

    async def publish_plan(self, plan: Plan) -> bool:
        """Store the plan this node leads with."""
        return self._put(RecordKind.PLAN, plan, self.config.plan_ttl)

    async def announce(self, kind: RecordKind, record, ttl: Optional[float] = None) -> bool:
        """Store this node's record of another kind (reports, evidence)."""
        return self._put(kind, record, self.config.peer_ttl if ttl is None else ttl)

    async def read(self, kind: RecordKind, cls: type) -> list[Signed]:
        """Live records of ``kind`` that are ``cls`` instances."""
        return [s for s in self._read(kind) if isinstance(s.record, cls)]

    async def withdraw(self, kind: RecordKind) -> bool:
        """Withdraw this node's record of ``kind``."""
        self.store.withdraw(kind, self.public_key)
        return True

    async def withdraw_all(self) -> None:
        """Withdraw every record this node stored."""
        for kind in RecordKind:
            self.store.withdraw(kind, self.public_key)

    def _read(self, kind: RecordKind) -> list[Signed]:
        self.calls[f"get_{kind.value}"] += 1
        out = []
        for signer, (rec, exp) in self.store.live(kind).items():
            reason = (membership_reason(kind.value, fake_peer_id(signer), frozenset(self.config.allowed_peers))
                      or identity_reason(rec, fake_peer_id(signer)))
            if reason is not None:
                self.rejected.append((kind.value, signer, reason))
            elif self._fits_model(rec):
                out.append(Signed(rec, signer, exp))
        return sorted(out, key=lambda s: s.expiration)  # by peer id below, the later expiring wins

    def _fits_model(self, record) -> bool:
        """Whether ``record`` passes the read-side check against the model, as ``Swarm`` reads."""
        try:
            validate_for_model(record, self.config.num_layers)
        except RecordRejected:
            return False
        return True

    async def get_peers(self) -> dict[str, Signed[PeerInfo]]:
        """Live PeerInfo records by peer id."""
        return {s.record.peer_id: s for s in self._read(RecordKind.PEERS)}

    async def get_links(self) -> dict[str, Signed[LinkInfo]]:
        """Live LinkInfo records by measuring peer id."""
        return {s.record.peer_id: s for s in self._read(RecordKind.LINKS)}

    async def get_candidates(self) -> list[Signed[CoordinatorCandidate]]:
        """Live candidacies."""
        return self._read(RecordKind.COORDINATORS)

    async def get_plans(self) -> list[SignedPlan]:
        """Live plans with their signers."""
        return [SignedPlan(s.record, s.signer) for s in self._read(RecordKind.PLAN)]

    async def get_plan(self) -> Optional[SignedPlan]:
        """The plan to follow: the highest live epoch (``None`` if none)."""
        return choose_plan(await self.get_plans())


class MissingReads(FakeSwarm):
    """A node whose reads of the peers miss those in ``miss`` (a slow replica, a timed-out get),
    while their records stay live in the store."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.miss: set[str] = set()

    async def get_peers(self):
        """The peers' records less the missed ones."""
        return {pid: s for pid, s in (await super().get_peers()).items() if pid not in self.miss}


class FakeDHT:
    """An in-memory stand-in for ``hivemind.DHT``'s dictionary ``store`` / ``get``, enough to
    test the real :class:`~p2pserve.dht.swarm.Swarm`'s writes and validated reads.

    ``data[key][subkey]`` is a :class:`FakeDHT.Entry` (``value``, ``expiration_time``), the
    shape hivemind returns; tests may write entries directly (forged, unsigned, absurd).
    """

    class Entry(NamedTuple):
        """One stored value and its expiration (hivemind's ``ValueWithExpiration``)."""

        value: object
        expiration_time: float

    def __init__(self):
        self.data: dict = {}

    def get(self, key: str, latest: bool = False, return_future: bool = False) -> Future:
        """The dictionary stored under ``key`` as one entry (None if empty), as a done future."""
        f: Future = Future()
        entries = self.data.get(key)
        f.set_result(None if not entries else
                     self.Entry(dict(entries), max(v.expiration_time for v in entries.values())))
        return f

    def store(self, key: str, value, expiration_time: float, subkey=None, return_future: bool = False) -> Future:
        """Store ``value`` under ``key`` / ``subkey``; always succeeds, as a done future."""
        self.data.setdefault(key, {})[subkey] = self.Entry(value, expiration_time)
        f: Future = Future()
        f.set_result(True)
        return f
