"""``SwarmWatch``: re-reads the swarm every ``DashboardConfig.refresh_s`` and keeps the latest
``/api/swarm`` document (the thin async shell around :func:`swarm_document`).

One DHT read and one document build per refresh however many browsers poll: ``/api/swarm``
answers from memory (only the request log is read per call). A read that fails keeps the last
snapshot (``error`` says why, ``stale_s`` how old it is).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

from p2pserve import clock as clocks
from p2pserve.clock import Clock
from p2pserve.config import DashboardConfig
from p2pserve.dashboard.document import observed_rates, swarm_document
from p2pserve.dashboard.history import History
from p2pserve.dashboard.requests import RecordingClient, RequestLog
from p2pserve.dashboard.snapshot import SwarmSnapshot, read_snapshot

log = logging.getLogger(__name__)


class SwarmWatch:
    """The dashboard's data: ``reader`` is a ``dht.view.SwarmView`` (None: no swarm, e.g. an API
    over fixed peers, whose page then shows only its own requests); ``source`` names the serving
    process; ``requests`` is its request log, if it makes requests."""

    def __init__(self, reader, config: DashboardConfig = DashboardConfig(), *, source: str, model: str,
                 swarm_id: str, num_layers: Optional[int] = None, requests: Optional[RequestLog] = None,
                 trusted_verifiers: tuple[str, ...] = (), clock: Clock = clocks.wall):
        self.reader = reader
        self.config = config
        self.requests = requests
        self.history = History(config.history_samples, config.history_peers)
        self._doc_args = dict(source=source, model=model, swarm_id=swarm_id, num_layers=num_layers,
                              trusted_verifiers=trusted_verifiers,
                              max_links=config.max_links)
        self._clock = clock
        self._snapshot = SwarmSnapshot(taken_at=clock())
        self._error: Optional[str] = None if reader is not None else "no swarm: this process uses fixed peers"
        self._read_at: Optional[float] = None
        self._doc = self._build()

    async def refresh(self) -> None:
        """Read the swarm once and add a history sample (a failed read keeps the last snapshot)."""
        if self.reader is not None:
            try:
                self._snapshot = await read_snapshot(self.reader, self._clock)
                self._error, self._read_at = None, self._snapshot.taken_at
            except Exception as e:  # a DHT hiccup: keep the last snapshot, say so on the page
                self._error = f"reading the swarm failed: {e!r}"
                log.warning(self._error)
        now = self._clock()
        plan = self._snapshot.plan
        tokens = self.requests.tokens_total if self.requests is not None else None
        observed = {pid: row["observed_tps"] for pid, row in self._observed().items()}
        self.history.add(now, plan.plan.max_flow if plan is not None else None,
                         self.history.served_rate(now, tokens), observed)
        self._doc = self._build()

    def _observed(self) -> dict[str, dict]:
        live = self._snapshot.peers
        return {pid: row for pid, row in observed_rates(self._snapshot.reports).items() if pid in live}

    def _build(self) -> dict[str, Any]:
        doc = swarm_document(self._snapshot, routes=None, history=self.history.as_json(), **self._doc_args)
        doc["error"] = self._error
        doc["refresh_s"] = self.config.refresh_s
        return doc

    def document(self) -> dict[str, Any]:
        """The ``/api/swarm`` document of the last refresh, with the request log as of now."""
        now = self._clock()
        return dict(self._doc, routes=self.requests.recent() if self.requests is not None else None,
                    stale_s=None if self._read_at is None else round(max(0.0, now - self._read_at), 2))

    async def run(self) -> None:
        """Refresh every ``refresh_s`` (the first one after a period: call :meth:`refresh` first
        for an immediate one) until cancelled; a failed refresh is logged and skipped."""
        while True:
            await asyncio.sleep(self.config.refresh_s)
            try:
                await self.refresh()
            except Exception:  # the view must outlive a bad tick, like every periodic loop
                log.exception("dashboard refresh failed; next period")


def client_dashboard(client, config: DashboardConfig = DashboardConfig()) -> tuple[RecordingClient, SwarmWatch]:
    """For a started ``AsyncClient`` (``p2pserve api --dashboard``): the client to serve
    requests with, which logs their routes, and the watch over its swarm view and that log."""
    requests = RequestLog(config.recent_requests)
    routes = getattr(client, "swarm_routes", None)
    reader = routes.swarm if routes is not None else None
    dcfg = getattr(reader, "config", None)
    watch = SwarmWatch(reader, config, source="api", model=dcfg.model if dcfg else client.model_id,
                       swarm_id=dcfg.swarm_id if dcfg else "", num_layers=client.info.spec.num_layers,
                       requests=requests)
    return RecordingClient(client, requests), watch
