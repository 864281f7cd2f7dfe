"""Records as their readers take them from the DHT: the signature validator every DHT node runs on
every store and get, the owner and key parsing of ``dht/signing.py``, and ``Swarm``'s readers
(which decode, validate and filter what a get returned).

Properties: the validator answers True or False, never raises, and accepts an owned record only
when its owner's signature covers exactly what is stored; the key helpers return a value or
raise ``ConfigError``; a Swarm reader returns only valid records for its model, each under the
key that signed it, whatever the DHT holds (unsigned entries, garbage, tombstones, NaN expiry).
"""

from __future__ import annotations

import dataclasses
import math

from hivemind.dht.validation import DHTRecord
from hypothesis import example, given
from hypothesis import strategies as st

from p2pserve.config import DHTConfig
from p2pserve.dht.identity import peer_id_of
from p2pserve.dht.keys import RecordKind, record_key
from p2pserve.dht.plan_store import index_key
from p2pserve.dht.records import CoordinatorCandidate, LinkInfo, PeerInfo, Plan
from p2pserve.dht.signing import (
    LoggingSignatureValidator,
    is_trusted,
    load_or_create_key,
    normalize_public_key,
    owner_of_subkey,
    owner_subkey,
    public_key_text,
    trusted_set,
)
from p2pserve.dht.swarm import Swarm
from p2pserve.errors import ConfigError
from p2pserve.testing import FakeDHT
from tests.fuzz import FUZZ, counted
from tests.fuzz.aio import run
from tests.fuzz.messages import RECORDS
from tests.fuzz.mutate import damage, hostile, pack, values

KEYS = [load_or_create_key(None) for _ in range(2)]
SUBKEYS = [owner_subkey(k) for k in KEYS]
TEXTS = [public_key_text(k) for k in KEYS]
TRUSTED = trusted_set(TEXTS[:1])
VALIDATOR = LoggingSignatureValidator(KEYS[0])
BASE = DHTRecord(key=b"s/m/peers", subkey=SUBKEYS[0], value=pack({"model": "m", "peer_id": "p"}), expiration_time=1e3)
SIGNED = dataclasses.replace(BASE, value=VALIDATOR.sign_value(BASE))
#: An owner marker whose key type the crypto library does not know (it raised UnsupportedAlgorithm).
ALIEN_OWNER = b"[owner:ssh-foo AAAA]"

owner_marks = st.sampled_from(SUBKEYS + [ALIEN_OWNER, b"[owner:]", b"[owner:ssh-rsa AAAA]"]) | st.binary(
    max_size=40).map(lambda b: b"[owner:" + b + b"]")
subkeys = owner_marks | st.binary(max_size=40) | st.sampled_from([b"", SUBKEYS[0] + SUBKEYS[1]])
signed_values = st.just(SIGNED.value).flatmap(damage) | st.binary(max_size=64) | st.binary(max_size=64).map(
    lambda b: BASE.value + b"[signature:" + b + b"]")
dht_records = st.builds(DHTRecord, key=st.sampled_from([BASE.key, BASE.key + ALIEN_OWNER]) | st.binary(max_size=24),
                        subkey=subkeys | st.none(), value=signed_values, expiration_time=st.floats())


@FUZZ
@given(st.just(SIGNED) | dht_records | st.builds(dataclasses.replace, st.just(SIGNED), subkey=subkeys))
@example(dataclasses.replace(SIGNED, subkey=ALIEN_OWNER))
@counted("signing.LoggingSignatureValidator")
def test_signature_validator(record):
    accepted = VALIDATOR.validate(record)
    assert accepted in (True, False)
    owned = VALIDATOR._PUBLIC_KEY_RE.findall(record.key) + VALIDATOR._PUBLIC_KEY_RE.findall(record.subkey or b"")
    if accepted and owned:  # an owned record passes only as its owner signed it
        stripped = VALIDATOR.strip_value(record)
        assert (record.key, record.subkey, stripped, record.expiration_time) == \
            (BASE.key, BASE.subkey, BASE.value, BASE.expiration_time)
    if record == SIGNED:
        assert accepted


key_texts = st.sampled_from(TEXTS).flatmap(lambda t: damage(t.encode())).map(lambda b: b.decode("latin-1")) | \
    st.text(max_size=60) | st.binary(max_size=48).map(lambda b: "ssh-rsa " + __import__("base64").b64encode(b).decode())


@FUZZ
@given(key_texts | st.sampled_from(TEXTS + ["ssh-foo AAAA", "ssh-rsa", " ssh-rsa  x y z "]), values)
@counted("signing.key_text")
def test_key_text_helpers(text, subkey):
    try:
        normal = normalize_public_key(text)
    except ConfigError:
        normal = None
    assert normal is None or normal.startswith("ssh-rsa ")
    assert is_trusted(text, TRUSTED) == (normal in TRUSTED)
    for candidate in (subkey, text, text.encode("utf-8", "surrogatepass")):
        owner = owner_of_subkey(candidate)
        assert owner is None or (isinstance(owner, str) and f"[owner:{owner}]".encode() in bytes(
            candidate.encode("utf-8", "surrogatepass") if isinstance(candidate, str) else candidate))


READERS = {RecordKind.PEERS: (PeerInfo, "get_peers"), RecordKind.LINKS: (LinkInfo, "get_links"),
           RecordKind.COORDINATORS: (CoordinatorCandidate, "get_candidates"), RecordKind.PLAN: (Plan, "get_plans")}


def _entries(kind: RecordKind):
    cls = READERS[kind][0]
    # for this model (and a candidate carrying a real key): records the readers' last filters pass
    # (a record about a peer carries its signer's peer id, as readers require)
    ours = RECORDS[cls].flatmap(lambda d: st.sampled_from(TEXTS).map(lambda t: _own(d, t)))
    value = st.one_of(st.just(b""), hostile(RECORDS[cls]), hostile(ours), ours.map(pack), ours.map(pack), values)
    # live (the clock reads 1000), expired, and expirations no honest node stores (beyond the TTL)
    expiry = st.sampled_from([1005.0, 5e3, 1e12, 999.0, -1.0, math.nan, math.inf]) | st.floats()
    return st.dictionaries(st.sampled_from(SUBKEYS) | subkeys, st.tuples(value, expiry), max_size=4)


def _own(d: dict, text: str) -> dict:
    """A record dict for model "m" as signed by ``text``'s key: its own public key and peer id."""
    return {**d, "model": "m", **{k: v for k, v in (("public_key", text), ("peer_id", peer_id_of(text))) if k in d}}


@FUZZ
@given(st.sampled_from(list(READERS)).flatmap(lambda k: st.tuples(st.just(k), _entries(k))))
@counted("swarm.readers")
def test_swarm_readers(case):
    kind, stored = case
    cls, method = READERS[kind]
    dht = FakeDHT()
    swarm = Swarm(DHTConfig(model="m", swarm_id="s", reject_log_interval=0.0), dht, KEYS[0], clock=lambda: 1e3)
    # a plan lives as an index and chunks (dht/plan_store.py): hostile bytes go where its index is
    key = index_key(swarm) if kind == RecordKind.PLAN else record_key("s", "m", kind)
    dht.data[key] = {sk: FakeDHT.Entry(v, e) for sk, (v, e) in stored.items()}
    found = run(getattr(swarm, method)())
    signed = list(found.values()) if isinstance(found, dict) else found
    signers = {owner_of_subkey(sk) for sk in stored}
    for s in signed:
        record = getattr(s, "record", None) or s.plan
        assert isinstance(record, cls) and record.model == "m" and s.signer in signers
        record.validate()
    if kind == RecordKind.PLAN:  # the plan a client follows is one of them, the highest epoch
        best = run(swarm.get_plan())
        assert best is None or (best in signed and best.plan.epoch == max(p.plan.epoch for p in signed))
