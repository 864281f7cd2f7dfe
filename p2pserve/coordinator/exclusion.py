"""Which peers get no flow because of verified evidence against them (pure; no I/O).

An :class:`~p2pserve.dht.evidence.Evidence` record lists mismatches a verifier found. A
mismatch *holds* (:func:`case_holds`) when every claim in it is signed by the reply key its peer
announces now (``PeerInfo.reply_key``), the witnesses' claims are over the very inputs of the
accused's (same span, positions and input commitment), and no peer appears twice. Signatures
prove what each peer answered; they cannot prove who computed right: that is the reporter's
comparison, which is why a holding case counts only when

* its reporter is a trusted verifier (``CoordinatorConfig.trusted_verifiers``, by the public key
  that signed its record or by its peer id, while ``trust_verifiers`` is on), or
* at least ``evidence_min_reporters`` distinct reporters (DHT signers) hold cases against the
  same peer that are also *self-evident* (:func:`~p2pserve.dht.evidence.self_evident`: two
  witnesses' signed outputs agree with each other and not with the accused's, checked here from
  the signed bytes, not taken from the reporter).

An excluded peer stays excluded for ``exclusion_s`` after the last evidence that held, even once
the records expire (:class:`ExclusionBook`). Its reason is what ``p2pserve status`` shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

from p2pserve.dht.evidence import Evidence, Mismatch, self_evident
from p2pserve.dht.records import PeerInfo
from p2pserve.dht.view import Signed
from p2pserve.types import PeerId


def case_holds(case: Mismatch, peers: Mapping[str, PeerInfo]) -> Optional[str]:
    """None when the case's claims are all signed by the keys their peers announce; else why not."""
    for signed in [case.accused, *case.witnesses]:
        info = peers.get(signed.claim.peer_id)
        if info is None or not info.reply_key:
            return f"{signed.claim.peer_id} announces no reply key"
        if signed.reply_key != info.reply_key:
            return f"claim of {signed.claim.peer_id} is under another reply key than it announces"
        if not signed.valid():
            return f"signature of {signed.claim.peer_id} does not verify"
    try:
        case.validate()
    except Exception as e:  # RecordRejected: claims about different inputs
        return str(e)
    return None


@dataclass(frozen=True)
class Verdict:
    """Why a peer is excluded: who reported it and what they found."""

    peer_id: PeerId
    reason: str
    until: float  # DHT time when the exclusion lapses unless new evidence holds


def judge(evidence: Sequence[Signed[Evidence]], peers: Mapping[str, PeerInfo], trusted: Callable[[str, str], bool],
          min_reporters: int) -> dict[str, str]:
    """Peers that the evidence excludes now, with the reason (see the module docstring).

    ``trusted(signer, reporter_id)`` says whether a record's author is a trusted verifier.
    """
    holding: dict[str, dict[str, str]] = {}  # accused -> signer -> description
    trusted_hits: dict[str, str] = {}
    for signed in evidence:
        record = signed.record
        for case in record.cases:
            accused = case.accused.claim.peer_id
            if accused == record.reporter_id or case_holds(case, peers) is not None:
                continue
            what = (f"{case.kind} mismatch on layers [{case.accused.claim.start}, {case.accused.claim.end}) at "
                    f"position {case.accused.claim.position}, outvoted by {len(case.witnesses)} replica(s)")
            if trusted(signed.signer, record.reporter_id):
                trusted_hits[accused] = f"{what}; reported by trusted verifier {record.reporter_id}"
            elif self_evident(case) is None:
                holding.setdefault(accused, {})[signed.signer] = what
    out = dict(trusted_hits)
    for accused, by in holding.items():
        if accused not in out and len(by) >= min_reporters:
            out[accused] = f"{next(iter(by.values()))}; reported by {len(by)} independent clients"
    return out


@dataclass
class ExclusionBook:
    """The coordinator's memory of exclusions: a verdict lasts ``exclusion_s`` past its last evidence."""

    exclusion_s: float
    verdicts: dict[str, Verdict] = field(default_factory=dict)

    def update(self, now: float, found: Mapping[str, str]) -> dict[str, Verdict]:
        """Add this round's findings, forget verdicts that ran out; returns those in force."""
        for peer, reason in found.items():
            self.verdicts[peer] = Verdict(peer, reason, now + self.exclusion_s)
        self.verdicts = {p: v for p, v in self.verdicts.items() if v.until > now}
        return dict(self.verdicts)
