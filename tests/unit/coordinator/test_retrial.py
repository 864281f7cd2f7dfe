"""The coordinator's retrial verdict (pure parts of ``coordinator/retrial.py``)."""

from __future__ import annotations

import random

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from p2pserve.coordinator.retrial import ACQUIT, CONVICT, INCONCLUSIVE, choose_replicas, decide
from p2pserve.dht.evidence import InputChain, Mismatch, SignedClaim, make_claim, output_digest, row_digests
from p2pserve.dht.records import PeerInfo
from p2pserve.protocol import SamplingParams, tokens_bytes

GOOD = torch.ones(1, 8)
HISTORY = torch.arange(4).numpy().tobytes()


def _signed(pid: str, output: bytes, kind: str = "hidden", count: int = 1) -> SignedClaim:
    commitment = InputChain().extend(row_digests(HISTORY, 4))
    claim = make_claim(model="m", peer_id=pid, session_id="s", start=0, end=2, position=4 - count, count=count,
                       commitment=commitment, output=output, kind=kind, dtype="float32", sampling=SamplingParams())
    return SignedClaim(claim, Ed25519PrivateKey.generate().sign(claim.digest()), "")


def _hidden_case(accused: torch.Tensor) -> Mismatch:
    out = accused.numpy().tobytes()
    return Mismatch(accused=_signed("A", output_digest(out)), witnesses=[_signed("B", b"x" * 32)], outputs=[out, b""],
                    history=HISTORY)


def test_hidden_states_convict_only_when_every_chosen_replica_agrees_against_the_signed_output():
    good, near, bad = (GOOD.numpy().tobytes(), (GOOD * 1.0001).numpy().tobytes(), (GOOD * 3).numpy().tobytes())
    assert _hidden_case(GOOD * 3).history_matches()
    assert decide(_hidden_case(GOOD * 3), {"B": good, "C": near}, 2).verdict == CONVICT
    assert decide(_hidden_case(GOOD * 1.0001), {"B": good, "C": good}, 2).verdict == ACQUIT  # honest rounding
    assert decide(_hidden_case(GOOD * 3), {"B": good}, 2).verdict == INCONCLUSIVE  # too few replicas
    assert decide(_hidden_case(GOOD * 3), {"B": good, "C": (GOOD * 5).numpy().tobytes()}, 2).verdict == INCONCLUSIVE
    assert decide(_hidden_case(GOOD * 3), {"B": good, "C": bad}, 2).verdict == ACQUIT  # a replica reproduces it


def test_tokens_are_compared_by_the_signed_digest_whatever_the_step_asked_for():
    one = Mismatch(accused=_signed("A", output_digest(token=7), "token"), witnesses=[_signed("B", b"x" * 32, "token")])
    assert decide(one, {"B": [7], "C": [7]}, 2).verdict == ACQUIT
    assert decide(one, {"B": [8], "C": [8]}, 2).verdict == CONVICT
    spec = Mismatch(accused=_signed("A", output_digest(tokens_bytes([3, 4])), "tokens", 2),
                    witnesses=[_signed("B", b"x" * 32, "tokens", 2)])
    assert decide(spec, {"B": [3, 4], "C": [3, 4]}, 2).verdict == ACQUIT
    assert decide(spec, {"B": [3, 5], "C": [3, 5]}, 2).verdict == CONVICT


def test_replicas_are_chosen_by_the_coordinator_the_reporters_witnesses_last():
    case = _hidden_case(GOOD * 3)
    peers = {pid: PeerInfo(model="m", peer_id=pid, serving=(0, 8), dtype="float32", state="serving", max_layers=8)
             for pid in "ABCDE"}
    peers["E"] = PeerInfo(model="m", peer_id="E", serving=(1, 8), dtype="float32", state="serving", max_layers=8)
    order = [p.peer_id for p in choose_replicas(case, peers, {"D"}, random.Random(0))]
    assert order == ["C", "B"]  # not the accused, not excluded D, not E (does not hold layer 0), witness B last
