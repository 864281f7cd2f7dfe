"""The operator's view: the swarm as JSON (``/api/swarm``) and as a live web page.

* :mod:`~p2pserve.dashboard.snapshot` — :class:`SwarmSnapshot`, every validated record at one
  instant, read through a ``SwarmView`` (no hivemind here);
* :mod:`~p2pserve.dashboard.swarm_status` — :func:`collect_status`, the JSON-ready status that
  ``p2pserve status`` prints (pure);
* :mod:`~p2pserve.dashboard.document` — :func:`swarm_document`, the ``/api/swarm`` document: the
  status plus layer coverage, observed rates, plan ranges, recent routes and history (pure);
* :mod:`~p2pserve.dashboard.history` and :mod:`~p2pserve.dashboard.requests` — the rolling
  tokens/s history and the log of this process's own requests (pure);
* :mod:`~p2pserve.dashboard.watch` — :class:`SwarmWatch`, the thin async loop that re-reads the
  swarm every ``DashboardConfig.refresh_s``;
* :mod:`~p2pserve.dashboard.app` and :mod:`~p2pserve.dashboard.server` — the ASGI app (page,
  static files, ``/api/swarm``) and its uvicorn server.

Nothing is imported here, so ``p2pserve status`` without ``--web`` never imports FastAPI.
"""
