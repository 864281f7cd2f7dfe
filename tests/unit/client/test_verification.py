"""Signed replies, the input commitment, the verdict rule and the exclusion policy.

Pure parts only; ``tests/integration/test_verification.py`` runs a corrupting peer process.
"""

from __future__ import annotations

import asyncio
import hashlib

import msgspec
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from p2pserve.client.hop import Hop
from p2pserve.client.trust.tape import HopTape
from p2pserve.client.trust.verdict import culprit, distance
from p2pserve.client.trust.verifier import TOLERANCE, token_windows
from p2pserve.config import CoordinatorConfig, DHTConfig
from p2pserve.coordinator.exclusion import ExclusionBook, case_holds, judge
from p2pserve.coordinator.service import CoordinatorService
from p2pserve.dht.evidence import (
    GENESIS,
    Evidence,
    InputChain,
    Mismatch,
    ReplyClaim,
    SignedClaim,
    derive_reply_key,
    output_digest,
    reply_key_text,
    row_digests,
    sign_claim,
    verify_claim,
)
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.records import PeerInfo, decode_record, encode_record
from p2pserve.dht.view import Signed
from p2pserve.errors import MalformedFrameError, RecordRejected
from p2pserve.peer.reply_signer import ReplySigner
from p2pserve.protocol import ForwardResult, decode_reply, encode_frame
from p2pserve.testing import FakeClock, FakeSwarm, FakeSwarmStore


def _der(seed_bits: int = 1024) -> bytes:
    key = rsa.generate_private_key(public_exponent=65537, key_size=seed_bits)
    return key.private_bytes(Encoding.DER, PrivateFormat.PKCS8, NoEncryption())


# ---------------------------------------------------------------------------------- commitment


def test_commitment_chain_is_the_documented_hash_chain_and_truncates_on_rewind():
    rows = [bytes([i]) * 8 for i in range(5)]
    chain = InputChain()
    c = GENESIS
    for r in rows:
        c = hashlib.sha256(c + hashlib.sha256(r).digest()).digest()
    assert chain.extend(row_digests(b"".join(rows), 5)) == c and chain.length == 5
    at3 = chain.at(3)
    chain.truncate(3)
    assert chain.length == 3 and chain.links[-1] == at3
    # the same three rows again give the same commitment; different ones do not
    assert chain.extend(row_digests(b"".join(rows[3:]), 2)) == c
    chain.truncate(3)
    assert chain.extend(row_digests(bytes(16), 2)) != c


def test_client_tape_mirrors_the_peer_commitment_through_a_rewind():
    peer_chain, signer = InputChain(), ReplySigner("p", "m")
    tape = HopTape(Hop("p", 0, 2), "s")
    steps = [(0, torch.arange(4)), (4, torch.tensor([7])), (5, torch.tensor([8])), (4, torch.tensor([9, 10]))]
    for position, ids in steps:  # the last one rewinds to position 4
        data = ids.numpy().tobytes()
        commitment = signer.consume(peer_chain, position, data, len(ids))
        tape.record(position, len(ids), "int64", data, ForwardResult(session_id="s", step=0, position=0), b"")
        assert tape.commitment(position + len(ids)) == commitment
    assert [s.inputs.position for s in tape.steps] == [0, 4]


def test_a_speculative_step_cut_by_a_rewind_keeps_its_signed_whole_and_the_tokens_kept():
    # Positions 0-3 a prompt (token after 3: 50), then a draft step: rows [50, 61, 62, 63] at
    # 4-7, tokens after each [61, 62, 70, 71]: drafts 61 and 62 accepted, 63 rejected (70 is
    # the correction), so the next step starts at 7 with 70 and rewinds row 7.
    peer_chain, signer = InputChain(), ReplySigner("p", "m")
    tape = HopTape(Hop("p", 0, 2), "s")
    spec_rows = torch.tensor([50, 61, 62, 63])
    steps = [(0, torch.arange(4), dict(token=50)), (4, spec_rows, dict(tokens=[61, 62, 70, 71])),
             (7, torch.tensor([70]), dict(token=80))]
    signed = []
    for position, ids, out in steps:
        data = ids.numpy().tobytes()
        signed.append(signer.consume(peer_chain, position, data, len(ids)))
        tape.record(position, len(ids), "int64", data, ForwardResult(session_id="s", step=0, position=0, **out), b"")
    head = tape.steps[1]
    assert head.reply is None and head.inputs.count == 3 and head.whole.inputs.count == 4
    assert head.tokens_kept() == [(4, 61), (5, 62), (6, 70)]  # 71 came after the rewound row
    assert tape.steps[0].tokens_kept() == [(3, 50)] and tape.steps[2].tokens_kept() == [(7, 80)]
    # the whole step's commitment is the one the peer signed, though row 7 is now another
    assert tape.commitment_of(head.whole) == signed[1] != tape.commitment(8)
    assert tape.commitment_of(tape.steps[2]) == tape.commitment(8)


def test_a_cut_hidden_step_keeps_the_output_rows_of_its_head():
    tape = HopTape(Hop("p", 0, 2), "s")
    out = torch.arange(12, dtype=torch.float32).reshape(4, 3).numpy().tobytes()
    tape.record(0, 4, "int64", torch.arange(4).numpy().tobytes(), ForwardResult(session_id="s", step=0, position=0), out)
    tape.record(2, 1, "int64", torch.tensor([9]).numpy().tobytes(), ForwardResult(session_id="s", step=1, position=0), b"")
    head = tape.steps[0]
    assert head.signed is head.whole and bytes(head.output_kept()) == out[:2 * 12]


def test_row_digests_refuse_a_payload_that_does_not_split():
    with pytest.raises(ValueError):
        row_digests(b"abc", 2)


# ---------------------------------------------------------------------------------- signatures


def _claim(**kw) -> ReplyClaim:
    base = dict(model="m", peer_id="P", session_id="s", start=0, end=2, position=3, count=1,
                commitment=hashlib.sha256(b"c").digest(), output=output_digest(b"out"))
    base.update(kw)
    return ReplyClaim(**base)


def test_reply_key_is_derived_deterministically_from_the_identity_key():
    der = _der()
    assert reply_key_text(derive_reply_key(der)) == reply_key_text(derive_reply_key(der))
    assert reply_key_text(derive_reply_key(der)) != reply_key_text(derive_reply_key(_der()))


def test_a_signature_covers_every_field_of_the_claim():
    key = derive_reply_key(_der())
    pub = reply_key_text(key)
    claim = _claim()
    sig = sign_claim(key, claim)
    assert verify_claim(pub, claim, sig)
    for change in (dict(model="x"), dict(peer_id="Q"), dict(session_id="t"), dict(start=1), dict(end=3),
                   dict(position=4), dict(count=2), dict(commitment=bytes(32)), dict(output=output_digest(token=5)),
                   dict(kind="token"), dict(dtype="bfloat16"), dict(temperature=0.5), dict(top_k=3), dict(top_p=0.5),
                   dict(seed=9)):
        assert not verify_claim(pub, _claim(**change), sig), change
    assert not verify_claim(reply_key_text(derive_reply_key(_der())), claim, sig)
    assert not verify_claim(pub, claim, sig[:-1]) and not verify_claim("zz" * 32, claim, sig)


def test_token_and_hidden_digests_differ():
    assert output_digest(token=1) != output_digest(token=2) != output_digest(b"")


def test_peer_info_reply_key_is_validated():
    key = reply_key_text(derive_reply_key(_der()))
    info = PeerInfo(model="m", peer_id="p", reply_key=key)
    assert decode_record(encode_record(info), PeerInfo).reply_key == key
    for bad in ("ab", "g" * 64, "00" * 31 + "0"):
        with pytest.raises(RecordRejected):
            PeerInfo(model="m", peer_id="p", reply_key=bad).validate()


def test_forward_result_signature_travels_and_is_bounded():
    reply = ForwardResult(session_id="s", step=1, position=2, token=3, signature=b"x" * 64)
    header = b"".join(bytes(p) for p in encode_frame(reply)[1:2])
    assert decode_reply(header).signature == b"x" * 64
    too_long = msgspec.msgpack.encode({"t": "result", "session_id": "s", "step": 1, "position": 2,
                                       "signature": b"x" * 65})
    with pytest.raises(MalformedFrameError):
        decode_reply(too_long)


# ---------------------------------------------------------------------------------- verdicts


def test_culprit_is_whoever_disagrees_with_both_others():
    assert culprit(True, None, None) is None  # accused and witness agree
    assert culprit(False, None, None) is None  # no third opinion: inconclusive
    assert culprit(False, False, True) == "accused"
    assert culprit(False, True, False) == "witness"
    assert culprit(False, False, False) is None  # three different answers
    assert culprit(True, False, False) is None


def test_distance_is_the_worst_relative_row_error():
    a = torch.randn(3, 16)
    assert distance(a, a) == 0.0
    b = a.clone()
    b[1] *= 1.5
    assert distance(b, a) == pytest.approx(0.5, rel=1e-5)
    assert distance(a.to(torch.bfloat16), a) < TOLERANCE["bfloat16"]


# ---------------------------------------------------------------------------------- exclusion


class _Peer:
    def __init__(self, pid: str):
        self.pid, self.key = pid, derive_reply_key(_der())
        self.info = PeerInfo(model="m", peer_id=pid, reply_key=reply_key_text(self.key), dtype="float32")

    def claim(self, output: bytes, **kw) -> SignedClaim:
        c = _claim(peer_id=self.pid, session_id="s-" + self.pid, output=output_digest(output), **kw)
        return SignedClaim(c, sign_claim(self.key, c), self.info.reply_key)


@pytest.fixture(scope="module")
def trio():
    return _Peer("A"), _Peer("B"), _Peer("C")


GOOD = torch.ones(1, 8).numpy().tobytes()  # one fp32 row of 8
NEAR = (torch.ones(1, 8) * 1.0001).numpy().tobytes()
BAD = (torch.ones(1, 8) * 3).numpy().tobytes()


def _case(trio, outputs=(BAD, GOOD, NEAR), carry: bool = True, **kw) -> Mismatch:
    a, b, c = trio
    return Mismatch(accused=a.claim(outputs[0]), witnesses=[b.claim(outputs[1]), c.claim(outputs[2])],
                    outputs=list(outputs) if carry else [], **kw)


def _evidence(signer: str, case: Mismatch, reporter: str = "client") -> Signed:
    return Signed(Evidence(model="m", reporter_id=reporter, cases=[case]), signer, 1e9)


def test_a_case_holds_only_under_the_announced_reply_keys(trio):
    peers = {p.pid: p.info for p in trio}
    assert case_holds(_case(trio), peers) is None
    impostor = _Peer("A")  # signs as A with another key
    forged = Mismatch(accused=impostor.claim(b"bad"), witnesses=_case(trio).witnesses)
    assert "another reply key" in case_holds(forged, peers)
    a, b, c = trio
    tampered = Mismatch(accused=SignedClaim(_claim(peer_id="A", output=output_digest(b"x")), a.claim(b"bad").signature,
                                            a.info.reply_key), witnesses=_case(trio).witnesses)
    assert "does not verify" in case_holds(tampered, peers)
    other_inputs = Mismatch(accused=a.claim(b"bad"), witnesses=[b.claim(b"good", position=4)])
    assert "other inputs" in case_holds(other_inputs, peers)
    assert "no reply key" in case_holds(_case(trio), {"A": a.info, "B": b.info})


def test_judge_convicts_on_a_trusted_verifier_and_only_accuses_on_anyone_else(trio):
    peers = {p.pid: p.info for p in trio}
    case = _case(trio)
    trusted = lambda signer, reporter: signer == "key-verifier"  # noqa: E731
    assert judge([_evidence("key-verifier", case)], peers, trusted).convicted.keys() == {"A"}
    # clients are cheap, so however many keys publish a case, it is an accusation: a reason for
    # the coordinator to re-execute the step (coordinator/retrial.py), never a verdict
    three = judge([_evidence(f"key-{i}", case) for i in range(3)], peers, trusted)
    assert three.convicted == {} and len(three.accused["A"]) == 3
    # honest outputs within tolerance of each other accuse nobody, whoever reports them
    framed = [_evidence(f"key-{i}", _case(trio, outputs=(GOOD, NEAR, NEAR))) for i in range(3)]
    assert judge(framed, peers, trusted).accused == {}
    no_outputs = [_evidence(f"key-{i}", _case(trio, carry=False)) for i in range(3)]
    assert judge(no_outputs, peers, trusted).accused == {}
    # a peer accusing itself counts for nothing; nor does a case naming an excluded peer
    assert judge([_evidence("key-verifier", case, reporter="A")], peers, trusted).convicted == {}
    assert judge([_evidence("key-verifier", case)], peers, trusted, excluded={"B"}).convicted == {}


def test_a_claim_binds_its_kind_dtype_and_sampling_and_the_reporter_cannot_relabel_them(trio):
    """The reporter picks none of what the judge compares: hidden states filed as tokens are still
    compared within tolerance, witnesses that sampled with another seed are about other outputs,
    and a claim in a dtype the peer does not announce does not hold."""
    from p2pserve.dht.evidence import self_evident

    peers = {p.pid: p.info for p in trio}
    a, b, c = trio
    honest = _case(trio, outputs=(GOOD, NEAR, NEAR))
    assert honest.kind == "hidden" and "within tolerance" in self_evident(honest)
    seeded = dict(kind="token", temperature=1.5, top_k=0, top_p=1.0)
    other_seeds = Mismatch(accused=a.claim(b"t1", seed=1, **seeded), witnesses=[b.claim(b"t2", seed=2, **seeded),
                                                                                c.claim(b"t2", seed=3, **seeded)])
    assert "other inputs" in case_holds(other_seeds, peers)
    same_seed = Mismatch(accused=a.claim(b"t1", seed=1, **seeded), witnesses=[b.claim(b"t2", seed=1, **seeded),
                                                                              c.claim(b"t2", seed=1, **seeded)])
    assert case_holds(same_seed, peers) is None and self_evident(same_seed) is None
    bf16 = Mismatch(accused=a.claim(BAD, dtype="bfloat16"), witnesses=[b.claim(GOOD, dtype="bfloat16"),
                                                                       c.claim(NEAR, dtype="bfloat16")])
    assert "announces float32" in case_holds(bf16, peers)
    with pytest.raises(RecordRejected):  # a greedy claim carrying a seed is not canonical
        _claim(kind="token", seed=5).validate()


def test_self_evidence_checks_the_signed_outputs(trio):
    from p2pserve.dht.evidence import self_evident

    assert self_evident(_case(trio)) is None
    assert "within tolerance" in self_evident(_case(trio, outputs=(NEAR, GOOD, GOOD)))
    assert "witnesses disagree" in self_evident(_case(trio, outputs=(BAD, GOOD, BAD)))
    a, b, c = trio
    swapped = Mismatch(accused=a.claim(BAD), witnesses=[b.claim(GOOD), c.claim(NEAR)], outputs=[GOOD, GOOD, NEAR])
    assert "does not hash" in self_evident(swapped)
    token = Mismatch(accused=a.claim(b"t1", kind="token"), witnesses=[b.claim(b"t2", kind="token"),
                                                                     c.claim(b"t2", kind="token")])
    assert self_evident(token) is None
    assert "fewer than two" in self_evident(Mismatch(accused=a.claim(BAD), witnesses=[b.claim(GOOD)]))


def test_numpy_and_torch_distances_agree():
    from p2pserve.dht.evidence import row_distance, rows_of

    a, b = torch.randn(3, 16), torch.randn(3, 16)
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to(dtype), b.to(dtype)
        name = str(dtype).removeprefix("torch.")
        np_d = row_distance(rows_of(name, x.view(torch.uint8).numpy().tobytes(), 3),
                            rows_of(name, y.view(torch.uint8).numpy().tobytes(), 3))
        assert np_d == pytest.approx(distance(x, y), rel=1e-5)


def test_exclusions_last_past_the_evidence_then_lapse():
    book = ExclusionBook(exclusion_s=10.0)
    assert book.update(0.0, {"A": "why"}).keys() == {"A"}
    assert book.update(9.0, {}).keys() == {"A"}
    assert book.update(10.5, {}) == {}


def test_the_coordinator_plans_without_a_peer_a_trusted_verifier_convicted(trio):
    store, clock = FakeSwarmStore(), FakeClock()
    cfg = DHTConfig(model="m", candidate_refresh=1.0, plan_refresh=2.0, max_clock_skew=0.0)
    table = [4.0, 3.0, 2.0, 1.0]
    for p in trio:
        info = msgspec.structs.replace(p.info, max_layers=4, throughput_decode=table, serving=(0, 4), state="serving")
        asyncio.run(FakeSwarm(store, p.pid, cfg).announce_peer(info))
    verifier = FakeSwarm(store, "verifier", cfg)
    asyncio.run(verifier.announce(RecordKind.EVIDENCE, Evidence(model="m", reporter_id="verifier",
                                                                 cases=[_case(trio)])))
    coord = CoordinatorService(FakeSwarm(store, "coord", cfg),
                               CoordinatorConfig(num_layers=4, priority=1, solve_time_limit=0.2, tick=0.01,
                                                 trusted_verifiers=("key-verifier",)), clock=clock)

    async def go():
        clock.advance(2.5)
        assert (await coord.step()).startswith("published")
        return coord.plan

    plan = asyncio.run(go())
    assert "A" not in plan.targets and "A" not in plan.spans and {"B", "C"} <= set(plan.spans)
    assert "trusted verifier" in coord.exclusions.verdicts["A"].reason


def test_status_shows_why_a_peer_is_excluded(trio):
    from p2pserve.cli.status import collect_status, format_status

    peers = {p.pid: p.info for p in trio}
    d = collect_status(peers, [], [], None, 0.0, evidence=[_evidence("key-v", _case(trio), reporter="V")],
                       trusted_verifiers=("V",))
    assert d["excluded"] == [{"peer_id": "A", "reason": d["excluded"][0]["reason"], "in_plan": False}]
    assert "trusted verifier V" in d["excluded"][0]["reason"] and d["accusations"][0]["holds"] == "yes"
    assert "EXCLUDED (1)" in format_status(d)
    untrusted = collect_status(peers, [], [], None, 0.0, evidence=[_evidence("key-v", _case(trio), reporter="V")])
    assert untrusted["excluded"] == [] and len(untrusted["accusations"]) == 1


def test_a_full_evidence_record_fits_the_dht_record_limit(trio):
    from p2pserve.dht.evidence import MAX_CASES, MAX_INPUT_BYTES, MAX_OUTPUT_BYTES
    from p2pserve.dht.records import MAX_RECORD_BYTES

    a, b, c = trio
    big = bytes(MAX_OUTPUT_BYTES)
    case = Mismatch(accused=a.claim(big), witnesses=[b.claim(big), c.claim(big)], inputs=bytes(MAX_INPUT_BYTES),
                    outputs=[big, big, big])
    record = Evidence(model="m", reporter_id="r", cases=[case] * MAX_CASES)
    assert len(msgspec.msgpack.encode(record)) < MAX_RECORD_BYTES
    assert decode_record(msgspec.msgpack.encode(record), Evidence).cases[0].outputs == [big] * 3
    with pytest.raises(RecordRejected):
        Evidence(model="m", reporter_id="r", cases=[case] * (MAX_CASES + 1)).validate()
    with pytest.raises(RecordRejected):
        msgspec.structs.replace(case, outputs=[big + b"x", big, big]).validate()


def test_hostile_evidence_bytes_get_typed_errors_and_judging_never_raises(trio):
    import random

    peers = {p.pid: p.info for p in trio}
    raw = bytearray(encode_record(Evidence(model="m", reporter_id="r", cases=[_case(trio)])))
    rng = random.Random(0)
    decoded = 0
    for _ in range(2000):
        data = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            record = decode_record(bytes(data), Evidence)
        except (MalformedFrameError, RecordRejected):
            continue
        decoded += 1
        for trusted in (True, False):  # must not raise, whichever path judges it
            judge([Signed(record, "key-x", 1e9)], peers, lambda s, r: trusted)
    assert decoded > 0


def test_token_windows_ask_for_every_returned_token_at_most_64_per_forward():
    """A last hop's check replays the history from position 0 and asks for the token after every
    position from the first one a step returned a token after: one Forward for a short session,
    several (at most 64 tokens each) for a long one, so no returned token goes unchecked."""
    payload = bytes(range(200)) * 4  # 200 rows of 4 bytes
    short = token_windows(first=3, end=19, rows=19, dtype="float32", payload=payload[:76])
    assert [(p, n, k) for p, n, _, _, k in short] == [(0, 19, 16)]
    calls = token_windows(first=9, end=200, rows=200, dtype="float32", payload=payload)
    assert [(p, n, k) for p, n, _, _, k in calls] == [(0, 73, 64), (73, 64, 64), (137, 63, 63)]
    assert b"".join(c[3] for c in calls) == payload
    asked = [p + n - k + i for p, n, _, _, k in calls for i in range(k)]
    assert asked == list(range(9, 200))
