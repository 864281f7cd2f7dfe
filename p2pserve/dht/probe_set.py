"""Which peers a peer probes: its region and a bounded sample of the rest (pure, no I/O).

Probing every peer makes the links the swarm measures, announces and reads grow with the square
of the peers: a thousand peers would announce a million links. The planner only needs the links
inside a region (pipelines stay there, :mod:`p2pserve.placement.regions`) and enough links
between regions to find them and to stitch them. So each round a peer probes at most:

* ``region_cap`` peers of its own region: those whose measured round trip is at most
  ``region_rtt_s``, nearest first;
* ``discover`` peers it has never measured (new peers may be in its region), in an order fixed
  by a hash of the two ids, so different peers discover different newcomers;
* ``sample`` of the other peers, in a hash order that changes every ``rotate`` rounds, so
  links between regions stay measured without any peer measuring all of them.

The result never exceeds ``region_cap + discover + sample``, and a peer announces only links to
peers of its current set (:func:`links_to_keep`), so link records grow with the peers, not
their square.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Mapping


@dataclass(frozen=True)
class ProbeSetConfig:
    """Bounds of a peer's probe set (see module docstring)."""

    region_rtt_s: float = 0.02
    region_cap: int = 64
    discover: int = 4
    sample: int = 8
    rotate: int = 10

    def __post_init__(self) -> None:
        for name in ("region_cap", "discover", "sample", "rotate"):
            if getattr(self, name) < 0 or (name == "rotate" and self.rotate < 1):
                raise ValueError(f"{name} must be non-negative (rotate at least 1)")

    @property
    def bound(self) -> int:
        """Most peers probed in one round."""
        return self.region_cap + self.discover + self.sample


def _rank(me: str, other: str, salt: int) -> bytes:
    """A stable pseudo-random rank of ``other`` as seen by ``me`` (different for every pair)."""
    return hashlib.blake2b(f"{me}|{other}|{salt}".encode(), digest_size=8).digest()


def probe_set(me: str, peers: Iterable[str], rtt: Mapping[str, float], round_no: int,
              cfg: ProbeSetConfig = ProbeSetConfig()) -> list[str]:
    """The peers ``me`` probes in round ``round_no``, given its measured round trips ``rtt``
    (peer -> seconds; peers absent were never measured). Sorted, without ``me``."""
    others = sorted({p for p in peers if p != me})
    region = sorted((p for p in others if p in rtt and rtt[p] <= cfg.region_rtt_s), key=lambda p: (rtt[p], p))
    chosen = set(region[:cfg.region_cap])
    unknown = sorted((p for p in others if p not in rtt), key=lambda p: _rank(me, p, 0))
    chosen.update(unknown[:cfg.discover])
    salt = 1 + round_no // cfg.rotate
    in_region = set(region)
    rest = sorted((p for p in others if p not in chosen and p not in in_region), key=lambda p: _rank(me, p, salt))
    chosen.update(rest[:cfg.sample])
    return sorted(chosen)


def links_to_keep(measured: Mapping[str, float], current: Iterable[str], me: str, peers: Iterable[str],
                  cfg: ProbeSetConfig = ProbeSetConfig()) -> list[str]:
    """Which measured links to announce: the region's (``region_cap`` nearest) and those to the
    current probe set, at most ``cfg.bound`` of them; older samples are dropped."""
    live = set(peers)
    keep = set(p for p in current if p in measured and p in live)
    region = sorted((p for p in measured if p in live and p != me and measured[p] <= cfg.region_rtt_s),
                    key=lambda p: (measured[p], p))
    keep.update(region[:cfg.region_cap])
    return sorted(keep, key=lambda p: (measured[p], p))[:cfg.bound]


def probe_round(me: str, addrs: Mapping[str, list[str]], rtt: Mapping[str, float], round_no: int,
                cfg: ProbeSetConfig = ProbeSetConfig()) -> tuple[dict[str, list[str]], set[str]]:
    """One round for a prober: the targets to probe (peer -> addresses, from the live peers
    ``addrs``) and the peers whose measured links to keep (the rest are forgotten, so the
    announced LinkInfo stays bounded)."""
    chosen = probe_set(me, addrs, rtt, round_no, cfg)
    keep = set(links_to_keep(rtt, chosen, me, addrs, cfg)) | set(chosen)
    return {p: list(addrs[p]) for p in chosen}, keep
