"""Which peers get no flow because of verified evidence against them (pure; no I/O).

An :class:`~p2pserve.dht.evidence.Evidence` record lists mismatches a verifier found. A
mismatch *holds* (:func:`case_holds`) when every claim in it is signed by the reply key its peer
announces now (``PeerInfo.reply_key``) in the dtype it announces, the witnesses' claims carry the
very terms of the accused's (same span, positions, input commitment, kind of output, dtype and
sampling: ``ReplyClaim.same_inputs``), no peer appears twice, and no peer in it is excluded
already. Signatures prove what each peer answered; they cannot prove who computed right, and
reporters' identities are free (a set of claims published under three fresh keys is one
reporter three times), so a holding case only decides anything when

* its reporter is a trusted verifier (``CoordinatorConfig.trusted_verifiers``, by the public key
  that signed its record or by its peer id, while ``trust_verifiers`` is on): the peer is
  excluded on its word; or
* it is *self-evident* (:func:`~p2pserve.dht.evidence.self_evident`, checked here from the signed
  bytes): then it is an **accusation**, a reason for the coordinator to look. The coordinator
  runs the accused step again itself on replicas it chooses (``coordinator/retrial.py``) and
  excludes only on its own result.

An excluded peer stays excluded for ``exclusion_s`` after the last verdict, even once the
records expire (:class:`ExclusionBook`). Its reason is what ``p2pserve status`` shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Collection, Mapping, Optional, Sequence

from p2pserve.dht.evidence import Evidence, Mismatch, self_evident
from p2pserve.dht.records import PeerInfo
from p2pserve.dht.view import Signed
from p2pserve.types import PeerId


def case_holds(case: Mismatch, peers: Mapping[str, PeerInfo], excluded: Collection[str] = frozenset()) -> Optional[str]:
    """None when the case's claims are all signed by the keys their peers announce, in the dtype
    they announce, and none of them is excluded already; else why not."""
    for signed in [case.accused, *case.witnesses]:
        pid = signed.claim.peer_id
        info = peers.get(pid)
        if pid in excluded:
            return f"{pid} is excluded already"
        if info is None or not info.reply_key:
            return f"{pid} announces no reply key"
        if signed.reply_key != info.reply_key:
            return f"claim of {pid} is under another reply key than it announces"
        if signed.claim.dtype != info.dtype:
            return f"claim of {pid} is in {signed.claim.dtype}, but it announces {info.dtype}"
        if not signed.valid():
            return f"signature of {pid} does not verify"
    try:
        case.validate()
    except Exception as e:  # RecordRejected: claims about different inputs
        return str(e)
    return None


def describe(case: Mismatch) -> str:
    """One line about what a case says."""
    c = case.accused.claim
    return (f"{case.kind} mismatch on layers [{c.start}, {c.end}) at position {c.position}, "
            f"outvoted by {len(case.witnesses)} replica(s)")


@dataclass
class Findings:
    """What one round of evidence says: ``convicted`` peers (a trusted verifier's holding case,
    with the reason) and ``accused`` peers (holding, self-evident cases from anyone else: each a
    reason for the coordinator to re-execute, never a verdict)."""

    convicted: dict[str, str] = field(default_factory=dict)
    accused: dict[str, list[tuple[str, Mismatch]]] = field(default_factory=dict)  # peer -> [(reporter, case)]


@dataclass(frozen=True)
class Verdict:
    """Why a peer is excluded: who reported it and what they found."""

    peer_id: PeerId
    reason: str
    until: float  # DHT time when the exclusion lapses unless new evidence holds


def judge(evidence: Sequence[Signed[Evidence]], peers: Mapping[str, PeerInfo], trusted: Callable[[str, str], bool],
          excluded: Collection[str] = frozenset()) -> Findings:
    """Sort this round's holding cases into convictions and accusations (see the module docstring).

    ``trusted(signer, reporter_id)`` says whether a record's author is a trusted verifier;
    ``excluded`` are the peers out already (no case is judged against them, nor on their word).
    """
    out = Findings()
    for signed in evidence:
        record = signed.record
        for case in record.cases:
            accused = case.accused.claim.peer_id
            if accused == record.reporter_id or accused in out.convicted or case_holds(case, peers, excluded) is not None:
                continue
            if trusted(signed.signer, record.reporter_id):
                out.convicted[accused] = f"{describe(case)}; reported by trusted verifier {record.reporter_id}"
                out.accused.pop(accused, None)
            elif self_evident(case) is None:
                out.accused.setdefault(accused, []).append((record.reporter_id, case))
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
