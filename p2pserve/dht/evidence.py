"""Signed replies and the evidence built from them (pure: hashing, Ed25519, msgspec; no I/O).

Every ``ForwardResult`` a peer sends carries an Ed25519 signature over a :class:`ReplyClaim`: the
model, the peer, the hop's session, its span, the positions it ran, a commitment to **every input
the session has consumed** so far, and a digest of what it returned. The commitment is a hash
chain over the input rows, ``c[0] = GENESIS``, ``c[i+1] = sha256(c[i] || sha256(row i))``
(:class:`InputChain`): the peer keeps one per session and the client mirrors it, both truncate
it when the session rewinds. Two claims with the same span, positions and commitment were made
over the same inputs, so their outputs must agree: a third party can re-execute them.

The reply key is derived from the peer's identity key (the RSA key that signs its DHT records)
with HKDF, so a peer has one stable reply key per identity, and announces its public half in
``PeerInfo.reply_key``. Signing costs one Ed25519 signature per reply (tens of µs).

:class:`Evidence` is the DHT record a verifier publishes on a mismatch: the accused's signed
claim and the signed claims of the replicas that outvoted it (see ``docs/trust.md``).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Iterable, Optional

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from p2pserve.dht.rows import row_distance, rows_of  # noqa: F401  (re-exported: readers import them from here)
from p2pserve.errors import RecordRejected
from p2pserve.types import PeerId, SessionId
from p2pserve.wire_types import SamplingParams

DOMAIN = b"p2pserve/reply-claim/3"
GENESIS = hashlib.sha256(b"p2pserve/inputs/1").digest()
DIGEST_BYTES = 32
SIGNATURE_BYTES = 64
REPLY_KEY_HEX = 64  # an Ed25519 public key as hex
# One record stays well under the DHT record limit (records.MAX_RECORD_BYTES, 4 MiB): at most
# 8 cases of (16 KiB inputs + 5 outputs of 16 KiB) plus claims, ~0.8 MiB. A decode step of a
# 4096-wide bf16 model (8 KiB a row) fits; a long prefill's rows do not and are left out.
MAX_CASES = 8  # mismatches one evidence record carries (one per accused peer)
MAX_WITNESSES = 4
MAX_INPUT_BYTES = 16 * 1024  # a step's input rows ride along when at most this big
MAX_OUTPUT_BYTES = 16 * 1024  # so does each claim's output (hidden states), for self_evident()
#: Largest relative L2 error of any row, ``|a - b| / |b|``, that two honest replicas may show on
#: the same inputs: a replay runs the history as one prefill where the accused ran it step by
#: step, so rounding differs (docs/trust.md "Calibration" has the measured maxima).
TOLERANCE = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 5e-2}
#: What a reply returned: hidden states, one sampled token, or the token after each of a step's
#: last positions (speculative verification, ``ForwardResult.tokens``).
KINDS = ("hidden", "token", "tokens")
#: Input rows a case carries from position 0 (``Mismatch.history``), so that a coordinator can
#: re-execute the accused step itself: 32 decode steps of a 4096-wide bf16 model.
MAX_HISTORY_BYTES = 256 * 1024
_U64 = (1 << 64) - 1
_HKDF_SALT = b"p2pserve reply key"
_HKDF_INFO = b"ed25519 reply key v1"


# ---------------------------------------------------------------------------------------------
# keys


def derive_reply_key(identity_der: bytes) -> Ed25519PrivateKey:
    """The Ed25519 reply key of a peer whose identity key serializes to ``identity_der`` (the
    DER of the RSA key that signs its DHT records): deterministic, so it survives restarts."""
    seed = HKDF(algorithm=hashes.SHA256(), length=32, salt=_HKDF_SALT, info=_HKDF_INFO).derive(identity_der)
    return Ed25519PrivateKey.from_private_bytes(seed)


def reply_key_text(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """The hex text of a reply key's public half (what ``PeerInfo.reply_key`` carries)."""
    if isinstance(key, Ed25519PrivateKey):
        key = key.public_key()
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return key.public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def check_reply_key(text: str) -> None:
    """Raise RecordRejected unless ``text`` is an Ed25519 public key in hex ("" = none)."""
    if text == "":
        return
    if len(text) != REPLY_KEY_HEX:
        raise RecordRejected(f"reply_key must be {REPLY_KEY_HEX} hex characters, got {len(text)}")
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(text))
    except ValueError as e:
        raise RecordRejected(f"reply_key is not an Ed25519 public key: {e}") from None


# ---------------------------------------------------------------------------------------------
# the input commitment


def row_digests(payload: bytes | memoryview, n: int) -> list[bytes]:
    """sha256 of each of the ``n`` equal rows of a Forward's input payload (token ids int64 [n],
    or hidden states [n, hidden]: row i is the bytes of token i)."""
    view = memoryview(payload).cast("B")
    if n <= 0 or len(view) % n:
        raise ValueError(f"{len(view)} payload bytes do not split into {n} rows")
    size = len(view) // n
    return [hashlib.sha256(view[i * size:(i + 1) * size]).digest() for i in range(n)]


class InputChain:
    """``c[0..length]`` of one session's inputs: ``c[i+1] = sha256(c[i] || sha256(row i))``.

    32 bytes per position. :meth:`truncate` follows a rewind, :meth:`extend` a Forward's rows.
    """

    __slots__ = ("links",)

    def __init__(self) -> None:
        self.links: list[bytes] = [GENESIS]

    @property
    def length(self) -> int:
        """Positions committed."""
        return len(self.links) - 1

    def truncate(self, position: int) -> None:
        """Forget the inputs at ``position`` and after."""
        del self.links[position + 1:]

    def extend(self, digests: Iterable[bytes]) -> bytes:
        """Append rows (their sha256 digests); returns the commitment after them."""
        c = self.links[-1]
        for d in digests:
            c = hashlib.sha256(c + d).digest()
            self.links.append(c)
        return c

    def at(self, position: int) -> bytes:
        """The commitment to the first ``position`` inputs."""
        return self.links[position]


def output_digest(payload: bytes | memoryview = b"", token: Optional[int] = None) -> bytes:
    """Digest of what a Forward returned: the hidden-state bytes, or the sampled token."""
    if token is not None:
        return hashlib.sha256(b"token" + struct.pack(">q", token)).digest()
    return hashlib.sha256(payload).digest()


# ---------------------------------------------------------------------------------------------
# claims and signatures


class ReplyClaim(msgspec.Struct, frozen=True, array_like=True):
    """What one signed reply asserts: over ``session_id`` on ``peer_id``, layers [start, end) of
    ``model`` turned the inputs at positions [position, position + count), after the inputs
    committed to by ``commitment`` (``c[position + count]``), into the output with ``output``
    as digest.

    It binds everything else that determines the output, so that nobody can present it as
    something else: ``kind`` (:data:`KINDS`), ``dtype`` (the peer's compute dtype: hidden
    inputs and outputs travel in it, and it sets the tolerance), and the sampling parameters of
    a token (canonical, all defaults, for hidden states and greedy tokens, whose output they do
    not change: :func:`sampling_terms`); ``extras`` the digest of the rest that decides a token
    (``min_p``, penalties and the token history, ``logit_bias``, the grammar's mask:
    ``dht/claim_extras.py``), empty when none is used; ``returned`` the digest of the
    log-probabilities the reply carried (an output: not among :meth:`terms`)."""

    model: str
    peer_id: PeerId
    session_id: SessionId
    start: int
    end: int
    position: int
    count: int
    commitment: bytes
    output: bytes
    kind: str = "hidden"
    dtype: str = "float32"
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    extras: bytes = b""
    returned: bytes = b""

    def digest(self) -> bytes:
        """What the signature covers: sha256 of the domain tag and every field, length-prefixed."""
        parts = [DOMAIN]
        for text in (self.model, self.peer_id, self.session_id, self.kind, self.dtype):
            raw = text.encode()
            parts += [struct.pack(">I", len(raw)), raw]
        parts.append(struct.pack(">QQQQ", self.start, self.end, self.position, self.count))
        parts.append(struct.pack(">dQdQ", self.temperature, self.top_k & _U64, self.top_p, self.seed & _U64))
        parts += [self.commitment, self.output]
        parts += [b for x in (self.extras, self.returned) for b in (struct.pack(">I", len(x)), x)]
        return hashlib.sha256(b"".join(parts)).digest()

    def same_inputs(self, other: "ReplyClaim") -> bool:
        """Whether both claims ran the same layers of the same model on the same inputs, for the
        same kind of output in the same dtype with the same sampling: their outputs must agree."""
        return self.terms() == other.terms()

    def terms(self) -> tuple:
        """Everything but the peer, its session and its output: what an honest output depends on."""
        return (self.model, self.start, self.end, self.position, self.count, self.commitment, self.kind,
                self.dtype, self.temperature, self.top_k, self.top_p, self.seed, self.extras)

    def validate(self) -> None:
        """Raise RecordRejected on malformed fields."""
        for name, text in (("model", self.model), ("peer_id", self.peer_id), ("session_id", self.session_id)):
            if not 1 <= len(text) <= 512:
                raise RecordRejected(f"claim {name} must be 1-512 characters")
        if not 0 <= self.start < self.end <= 4096 or not 0 <= self.position < 1 << 40 or not 1 <= self.count < 1 << 40:
            raise RecordRejected("claim span or positions out of range")
        if len(self.commitment) != DIGEST_BYTES or len(self.output) != DIGEST_BYTES or (
                {len(self.extras), len(self.returned)} - {0, DIGEST_BYTES}
                or self.kind == "hidden" and (self.extras or self.returned)):
            raise RecordRejected("claim digests must be 32 bytes")
        if self.kind not in KINDS or self.dtype not in TOLERANCE:
            raise RecordRejected(f"claim kind {self.kind!r} / dtype {self.dtype!r} unknown")
        if (self.temperature, self.top_k, self.top_p, self.seed) != sampling_terms(
                self.kind, SamplingParams(self.temperature, self.top_k, self.top_p, self.seed)):
            raise RecordRejected("claim sampling parameters are not in canonical form")


def sampling_terms(kind: str, sampling: SamplingParams) -> tuple[float, int, float, int]:
    """The sampling fields a claim carries: the defaults where they cannot change the output
    (hidden states; greedy tokens), else ``sampling``'s own. A replica replaying a greedy step
    with another seed therefore signs the same terms, and a sampled step's only with the same seed."""
    if kind == "hidden" or sampling.temperature == 0.0:
        return 0.0, 0, 1.0, 0
    return float(sampling.temperature), int(sampling.top_k), float(sampling.top_p), int(sampling.seed)


def make_claim(*, model: str, peer_id: str, session_id: str, start: int, end: int, position: int, count: int,
               commitment: bytes, output: bytes, kind: str, dtype: str, sampling: SamplingParams,
               extras: bytes = b"", returned: bytes = b"") -> ReplyClaim:
    """The claim of one reply, its sampling fields canonical (:func:`sampling_terms`); ``extras``
    and ``returned`` (``dht/claim_extras.py``) are dropped for hidden states."""
    t, k, p, seed = sampling_terms(kind, sampling)
    return ReplyClaim(model=model, peer_id=peer_id, session_id=session_id, start=start, end=end, position=position,
                      count=count, commitment=commitment, output=output, kind=kind, dtype=dtype, temperature=t,
                      top_k=k, top_p=p, seed=seed, extras=b"" if kind == "hidden" else extras,
                      returned=b"" if kind == "hidden" else returned)


def sign_claim(key: Ed25519PrivateKey, claim: ReplyClaim) -> bytes:
    """The reply key's signature over ``claim``."""
    return key.sign(claim.digest())


def verify_claim(reply_key_hex: str, claim: ReplyClaim, signature: bytes) -> bool:
    """Whether ``signature`` is the signature of the reply key ``reply_key_hex`` over ``claim``."""
    if len(signature) != SIGNATURE_BYTES or len(reply_key_hex) != REPLY_KEY_HEX:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(reply_key_hex)).verify(signature, claim.digest())
    except (InvalidSignature, ValueError):
        return False
    return True


class SignedClaim(msgspec.Struct, frozen=True, array_like=True):
    """A claim with its signature, and the reply key that made it (as announced then)."""

    claim: ReplyClaim
    signature: bytes
    reply_key: str

    def valid(self) -> bool:
        """Whether the signature checks out against ``reply_key``."""
        return verify_claim(self.reply_key, self.claim, self.signature)


# ---------------------------------------------------------------------------------------------
# the evidence record


class Mismatch(msgspec.Struct, kw_only=True, frozen=True):
    """One accusation: ``accused`` disagreed with every witness, and the witnesses agreed.

    What was compared, and how, comes from the signed claims, never from the reporter: ``kind``
    and ``dtype`` are the accused claim's (hidden states are compared within the dtype's
    :data:`TOLERANCE`, tokens exactly), and every witness claim must carry the same terms
    (:meth:`ReplyClaim.same_inputs`). ``distance`` and ``tolerance`` are the reporter's figures,
    for people to read. ``history`` holds the session's input rows from position 0 through the
    accused step (at most :data:`MAX_HISTORY_BYTES`; their hash chain must be the accused's
    commitment), so that a coordinator can run the step again itself; ``inputs`` the step's own
    rows when they are small (at most ``MAX_INPUT_BYTES``).
    """

    accused: SignedClaim
    witnesses: list[SignedClaim]
    distance: float = 0.0
    tolerance: float = 0.0
    inputs: bytes = b""
    outputs: list[bytes] = []  # the accused's then each witness's output bytes, when small
    history: bytes = b""
    found_at: float = 0.0

    @property
    def kind(self) -> str:
        """What the accused signed it returned (``ReplyClaim.kind``)."""
        return self.accused.claim.kind

    @property
    def dtype(self) -> str:
        """The accused's signed compute dtype (``ReplyClaim.dtype``)."""
        return self.accused.claim.dtype

    def history_matches(self) -> bool:
        """Whether ``history`` is exactly the inputs the accused's commitment covers."""
        claim = self.accused.claim
        rows = claim.position + claim.count
        if not self.history or len(self.history) % rows:
            return False
        chain = InputChain()
        return chain.extend(row_digests(self.history, rows)) == claim.commitment

    def validate(self) -> None:
        """Raise RecordRejected unless the claims are well-formed and about the same inputs."""
        if not 1 <= len(self.witnesses) <= MAX_WITNESSES:
            raise RecordRejected(f"a mismatch needs 1-{MAX_WITNESSES} witnesses")
        if len(self.inputs) > MAX_INPUT_BYTES or len(self.history) > MAX_HISTORY_BYTES:
            raise RecordRejected("mismatch inputs or history too large")
        if self.outputs and (len(self.outputs) != 1 + len(self.witnesses)
                             or any(len(o) > MAX_OUTPUT_BYTES for o in self.outputs)):
            raise RecordRejected(f"mismatch outputs must be one per claim, each at most {MAX_OUTPUT_BYTES} bytes")
        self.accused.claim.validate()
        peers = {self.accused.claim.peer_id}
        for w in self.witnesses:
            w.claim.validate()
            if not w.claim.same_inputs(self.accused.claim):
                raise RecordRejected("a witness claim is about other inputs, outputs or sampling than the accused's")
            if w.claim.peer_id in peers:
                raise RecordRejected("a peer appears twice in one mismatch")
            peers.add(w.claim.peer_id)
        for name, x in (("distance", self.distance), ("tolerance", self.tolerance), ("found_at", self.found_at)):
            if not 0.0 <= x <= 1e11:  # NaN fails this too
                raise RecordRejected(f"mismatch {name}={x!r} out of range")


def self_evident(case: Mismatch) -> Optional[str]:
    """None when the signed claims alone show the accused outvoted, else why they do not.

    Tokens: the witnesses signed one token and the accused another (digests of tokens are
    equal exactly when the tokens are). Hidden states: the outputs ride along, hash to what each
    peer signed, the witnesses agree within the dtype's :data:`TOLERANCE` and the accused is
    beyond it from each. Nobody has to trust the reporter's comparison then; only its choice of
    witnesses (they could be the accused's accomplices or foes: see docs/trust.md).
    """
    accused, witnesses = case.accused.claim, [w.claim for w in case.witnesses]
    if len(witnesses) < 2:
        return "fewer than two witnesses"
    if case.kind != "hidden":
        if len({w.output for w in witnesses}) != 1 or accused.output == witnesses[0].output:
            return "the signed tokens do not outvote the accused"
        return None
    tol = TOLERANCE.get(case.dtype)
    if tol is None or len(case.outputs) != 1 + len(witnesses):
        return "hidden states without their outputs"
    if any(hashlib.sha256(o).digest() != c.output for o, c in zip(case.outputs, [accused, *witnesses])):
        return "an output does not hash to its signed digest"
    try:
        rows = [rows_of(case.dtype, o, accused.count) for o in case.outputs]
    except ValueError as e:
        return str(e)
    if any(row_distance(w, rows[1]) > tol for w in rows[2:]):
        return "the witnesses disagree"
    if any(row_distance(rows[0], w) <= tol for w in rows[1:]):
        return "the accused is within tolerance of a witness"
    return None


class Evidence(msgspec.Struct, kw_only=True, frozen=True):
    """What one verifier (``reporter_id``, its own peer id) found: up to ``MAX_CASES`` mismatches."""

    schema: int = 1
    model: str
    reporter_id: str
    cases: list[Mismatch] = []
    timestamp: float = 0.0

    def validate(self) -> None:
        """Raise RecordRejected on malformed fields."""
        if self.schema != 1:
            raise RecordRejected(f"evidence schema {self.schema} not supported")
        if not 1 <= len(self.model) <= 512 or not 1 <= len(self.reporter_id) <= 512:
            raise RecordRejected("evidence model / reporter_id must be 1-512 characters")
        if len(self.cases) > MAX_CASES:
            raise RecordRejected(f"{len(self.cases)} cases, at most {MAX_CASES}")
        for case in self.cases:
            case.validate()
        if not 0.0 <= self.timestamp <= 1e11:
            raise RecordRejected(f"timestamp={self.timestamp!r} out of range")
