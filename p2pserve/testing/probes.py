"""A link prober in memory: the agent's ``LinkProbes`` protocol, measuring nothing."""

from __future__ import annotations

from typing import Iterable

from p2pserve.config import ProberConfig
from p2pserve.dht.records import LinkStat


class FakeLinkProbes:
    """Answers every due probe with ``stat`` and keeps what the real prober keeps: one result per
    peer, forgotten for peers outside ``keep``, each peer probed again only after
    ``forget`` dropped it (as if ``min_interval_s`` were forever). ``probed`` lists the
    targets of every probe, in order."""

    def __init__(self, stat: LinkStat = LinkStat(bandwidth=1e6, rtt=0.05, measured_at=0.0),
                 config: ProberConfig = ProberConfig()):
        self.stat = stat
        self.config = config
        self.probed: list[str] = []
        self._results: dict[str, LinkStat] = {}

    async def start(self) -> None:
        """Nothing to serve."""

    async def stop(self) -> None:
        """Nothing to stop."""

    @property
    def results(self) -> dict[str, LinkStat]:
        """The measured links by peer id."""
        return dict(self._results)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop results for peers not in ``keep``."""
        keep = set(keep)
        self._results = {p: s for p, s in self._results.items() if p in keep}

    async def probe_many(self, targets: dict[str, list[str]]) -> dict[str, LinkStat]:
        """Probe every target without a result; returns the fresh ones."""
        fresh = {p: self.stat for p in targets if p not in self._results}
        self.probed += list(fresh)
        self._results.update(fresh)
        return fresh
