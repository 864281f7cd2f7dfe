"""``ReplyClaim.extras``: a signed token binds every sampling field, the token history the
penalties read, the grammar's mask and the log-probabilities returned (``dht/claim_extras.py``)."""

from __future__ import annotations

import asyncio

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from p2pserve.coordinator.retrial import INCONCLUSIVE, Retrials
from p2pserve.dht.claim_extras import extras_digest, returned_digest
from p2pserve.dht.evidence import DOMAIN, Mismatch, ReplyClaim, SignedClaim, make_claim, output_digest
from p2pserve.errors import RecordRejected
from p2pserve.protocol import Logprobs, SamplingParams

PLAIN = SamplingParams(temperature=0.7, seed=3)
LP = Logprobs(count=1, k=0, chosen=b"\x00\x00\x80\xbf")


def _claim(extras: bytes = b"", kind: str = "token", peer: str = "A", token: int = 5) -> ReplyClaim:
    return make_claim(model="m", peer_id=peer, session_id="s", start=0, end=2, position=3, count=1,
                      commitment=b"c" * 32, output=output_digest(token=token), kind=kind, dtype="float32",
                      sampling=PLAIN, extras=extras)


def _fields(claim: ReplyClaim) -> dict:
    return dict(model=claim.model, peer_id=claim.peer_id, session_id=claim.session_id, start=claim.start, end=claim.end,
                position=claim.position, count=claim.count, commitment=claim.commitment, output=claim.output,
                kind=claim.kind, dtype=claim.dtype, sampling=PLAIN, extras=claim.extras)


def test_a_plain_token_binds_nothing_more_and_every_extra_changes_the_digest():
    assert DOMAIN.endswith(b"/3")
    assert extras_digest(PLAIN, [1, 2, 3]) == b""  # no penalty: the history decides nothing
    penalty = SamplingParams(temperature=0.7, seed=3, presence_penalty=0.5, penalty_start=2)
    variants = [
        extras_digest(SamplingParams(temperature=0.7, seed=3, min_p=0.1)),
        extras_digest(SamplingParams(temperature=0.7, seed=3, logit_bias=[(4, 2.0)])),
        extras_digest(SamplingParams(temperature=0.7, seed=3, logit_bias=[(4, 3.0)])),
        extras_digest(SamplingParams(temperature=0.7, seed=3, repetition_penalty=1.2), [1, 2, 3]),
        extras_digest(penalty, [1, 2, 3]),
        extras_digest(penalty, [1, 2, 4]),  # another history
        extras_digest(SamplingParams(temperature=0.7, seed=3, presence_penalty=0.5, penalty_start=1), [1, 2, 3]),
        extras_digest(PLAIN, allowed=b"\xff\x00\x00\x00"),
        extras_digest(PLAIN, allowed=b"\xfe\x00\x00\x00"),  # another mask
        extras_digest(SamplingParams(temperature=0.7, seed=3, logprobs=True, top_logprobs=2)),
        returned_digest(LP),
        returned_digest(Logprobs(count=1, k=0, chosen=b"\x00\x00\x00\xbf")),
        returned_digest(None, LP),
    ]
    assert returned_digest() == b""
    assert all(len(v) == 32 for v in variants) and len(set(variants)) == len(variants)


def test_claims_with_other_extras_are_not_about_the_same_inputs_and_sign_differently():
    plain, masked = _claim(), _claim(extras_digest(PLAIN, allowed=b"\x01\x00\x00\x00"))
    assert not plain.same_inputs(masked) and plain.digest() != masked.digest()
    assert masked.same_inputs(_claim(masked.extras, peer="B", token=6))
    assert _claim(masked.extras, kind="hidden").extras == b""  # hidden states: nothing to bind
    with_lp = make_claim(**{**_fields(masked), "returned": returned_digest(LP)})
    assert with_lp.same_inputs(masked) and with_lp.digest() != masked.digest()  # an output: signed, not a term
    with pytest.raises(RecordRejected):
        ReplyClaim(**{**{f: getattr(plain, f) for f in plain.__struct_fields__}, "extras": b"x"}).validate()


def test_a_retrial_does_not_judge_a_token_made_under_extras_it_cannot_reproduce():
    """A reporter presenting an honest peer's claim made under a penalty or a mask as if it were
    plain would have the coordinator replay it without them: the retrial refuses instead."""
    key = Ed25519PrivateKey.generate()

    def signed(claim):
        return SignedClaim(claim, key.sign(claim.digest()), "")

    extras = extras_digest(SamplingParams(temperature=0.7, seed=3, frequency_penalty=1.0), [1, 2, 3, 4])
    case = Mismatch(accused=signed(_claim(extras)), witnesses=[signed(_claim(extras, peer="B", token=6))])

    async def node():
        raise AssertionError("no replica may be asked")

    outcome = asyncio.run(Retrials(node, seed=0).retry(case, {}, frozenset()))
    assert outcome.verdict == INCONCLUSIVE
