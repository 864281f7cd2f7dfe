"""Prometheus metrics: the series each role exports, and the small HTTP server that serves them.

One class per role (:class:`PeerMetrics`, :class:`ClientMetrics`, :class:`CoordinatorMetrics`)
defines its families on a :class:`~prometheus_client.CollectorRegistry` of its own, never the
process-wide default: tests and benchmarks run several peers, clients and coordinators in one
process, and each must export its own numbers under the same names. The owners update them
where the work happens (the peer's compute loop and request handler, the client's pipeline and
generation, the coordinator's round), at the cost of a counter increment or a histogram
observation; state that exists anyway (KV budget, queue, plan epoch) is read when scraped.

Series are listed, with their units and labels, in ``docs/metrics.md``. Error labels come from
:func:`error_code`, a fixed set of values whatever a remote node sends, so hostile input cannot
grow the number of series.

:func:`serve_metrics` serves a registry on its own port (the peer and the coordinator); the
OpenAI API mounts ``prometheus_client.make_asgi_app`` on its FastAPI app instead.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from p2pserve.config import MetricsConfig
from p2pserve.errors import (
    AllRoutesOverloadedError,
    ConfigError,
    ErrorCode,
    GenerationFailedError,
    NoRouteError,
    ProtocolError,
    RequestError,
    RoutingError,
)

log = logging.getLogger(__name__)

#: Codes a client counts besides the wire codes: failures that never crossed the wire as a reply.
CLIENT_CODES = ("timeout", "connection", "no_route", "all_routes_overloaded", "generation_failed")

# Buckets, in the series' units. Hops and steps: sub-millisecond on loopback to seconds on a WAN
# prefill; first tokens: a prefill through the whole chain; solves: up to the solver's time limit.
SECONDS_FAST = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
SECONDS_FIRST_TOKEN = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SECONDS_SOLVE = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
POWERS_OF_TWO = tuple(float(2**i) for i in range(13))  # 1 .. 4096 (tokens or sessions in one step)


def error_code(exc: BaseException) -> str:
    """The ``code`` label of an error: its wire code (``errors.ErrorCode``) when it has one, else
    one of :data:`CLIENT_CODES` or ``internal``; never text taken from the error itself."""
    if isinstance(exc, (ProtocolError, RequestError)):
        return exc.code.value
    if isinstance(exc, AllRoutesOverloadedError):
        return "all_routes_overloaded"
    if isinstance(exc, GenerationFailedError):
        return "generation_failed"
    if isinstance(exc, NoRouteError) and exc.overloaded:  # load alone blocks every route (HTTP 429)
        return "all_routes_overloaded"
    if isinstance(exc, RoutingError):
        return "no_route"
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return "timeout"
    if isinstance(exc, (ConnectionError, EOFError, OSError)):  # asyncio.IncompleteReadError is an EOFError
        return "connection"
    return ErrorCode.INTERNAL.value


class StateCollector(Collector):
    """Series read together from the owner's state at scrape time: ``read()`` returns one value
    per name of ``series`` (name -> help text), so related values (KV used and free) are
    consistent with each other and nothing is paid between scrapes. Names in ``counters`` are
    counts the owner keeps anyway (exported as counters, ``_total``); the rest are gauges."""

    def __init__(self, series: Mapping[str, str], read: Callable[[], Mapping[str, float]],
                 counters: Iterable[str] = ()):
        self.series = dict(series)
        self.read = read
        self.counters = frozenset(counters)

    def _family(self, name: str, value: Optional[float] = None) -> Metric:
        kind = CounterMetricFamily if name in self.counters else GaugeMetricFamily
        return kind(name, self.series[name], value=value)

    def describe(self) -> Iterable[Metric]:
        """The families, without reading the state (what the registry checks names with)."""
        return [self._family(name) for name in self.series]

    def collect(self) -> Iterable[Metric]:
        """The current values; nothing (and a log line) if the owner's state cannot be read."""
        try:
            values = self.read()
        except Exception:  # a scrape must not take the role down, nor fail the other series
            log.exception("reading metrics state failed")
            return []
        return [self._family(name, float(values[name])) for name in self.series if name in values]


def _errors(registry: CollectorRegistry, name: str, text: str, codes: Iterable[str]) -> Counter:
    counter = Counter(name, text, ["code"], registry=registry)
    for code in codes:  # every known code present from the start, at 0
        counter.labels(code)
    return counter


WIRE_CODES = tuple(c.value for c in ErrorCode)

#: The peer's state gauges (read at scrape time): name -> help.
PEER_STATE = {
    "p2pserve_peer_kv_capacity_token_layers": "KV budget in token-layer slots (one token's K/V in one layer)",
    "p2pserve_peer_kv_used_token_layers": "KV token-layer slots reserved by open sessions",
    "p2pserve_peer_kv_free_token_layers": "KV token-layer slots free for new sessions",
    "p2pserve_peer_queue_jobs": "Forward requests waiting for or in the compute thread (queue depth)",
    "p2pserve_peer_queue_tokens": "Tokens of those requests not yet computed",
    "p2pserve_peer_sessions": "Open sessions",
    "p2pserve_peer_streams": "Open session streams",
    "p2pserve_peer_served_start_layer": "First layer served (with end = start: none)",
    "p2pserve_peer_served_end_layer": "End of the served layer range (exclusive)",
    "p2pserve_peer_compute_restarts": "Compute threads restarted by the watchdog",
}
PEER_STATE_COUNTERS = ("p2pserve_peer_compute_restarts",)


class PeerMetrics:
    """A peer's series: compute steps (tokens, batch sizes, step time) and answered errors; its
    state gauges come from ``state`` (see :data:`PEER_STATE`), read when scraped."""

    def __init__(self, state: Callable[[], Mapping[str, float]], registry: Optional[CollectorRegistry] = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.tokens = Counter("p2pserve_peer_tokens", "Tokens computed (prefill and decode, every session)",
                              registry=r)
        self.batch_tokens = Histogram("p2pserve_peer_batch_tokens", "Tokens in one compute step",
                                      buckets=POWERS_OF_TWO, registry=r)
        self.batch_sessions = Histogram("p2pserve_peer_batch_sessions", "Sessions (chunks) in one compute step",
                                        buckets=POWERS_OF_TWO, registry=r)
        self.step_seconds = Histogram("p2pserve_peer_step_seconds", "Shard forward time of one compute step",
                                      buckets=SECONDS_FAST, registry=r)
        self.errors = _errors(r, "p2pserve_peer_errors", "Error replies sent, by code", WIRE_CODES)
        r.register(StateCollector(PEER_STATE, state, PEER_STATE_COUNTERS))

    def step(self, tokens: int, sessions: int, seconds: float) -> None:
        """One compute step ran ``tokens`` tokens of ``sessions`` sessions in ``seconds``."""
        self.tokens.inc(tokens)
        self.batch_tokens.observe(tokens)
        self.batch_sessions.observe(sessions)
        self.step_seconds.observe(seconds)

    def error(self, exc: BaseException) -> None:
        """An error reply was sent for ``exc``."""
        self.errors.labels(error_code(exc)).inc()


class ClientMetrics:
    """A client's series (and the OpenAI API's, which serves one client's registry)."""

    def __init__(self, registry: Optional[CollectorRegistry] = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("p2pserve_client_requests", "Generations started", registry=r)
        self.tokens = Counter("p2pserve_client_generated_tokens", "Tokens generated (returned to the caller)",
                              registry=r)
        hops = Histogram("p2pserve_client_hop_seconds", "One hop's Forward round trip, as the client sees it",
                         ["kind"], buckets=SECONDS_FAST, registry=r)
        # resolved once: the decode path observes a child, no label lookup per hop
        self.hop_decode, self.hop_prefill = hops.labels("decode"), hops.labels("prefill")
        self.first_token = Histogram("p2pserve_client_time_to_first_token_seconds",
                                     "From the generation's start (prompt tokenised) to its first token",
                                     buckets=SECONDS_FIRST_TOKEN, registry=r)
        self.failovers = Counter("p2pserve_client_failovers", "Routes opened in place of one whose hop failed",
                                 registry=r)
        self.hop_errors = _errors(r, "p2pserve_client_hop_errors", "Failed hops, by code",
                                  WIRE_CODES + CLIENT_CODES)
        self.request_errors = _errors(r, "p2pserve_client_request_errors", "Failed generations, by code",
                                      WIRE_CODES + CLIENT_CODES)


class CoordinatorMetrics:
    """A coordinator's series: leadership, the plan it published, solve times, failed rounds."""

    def __init__(self, registry: Optional[CollectorRegistry] = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.leader = Gauge("p2pserve_coordinator_leader", "1 while this coordinator is the elected leader",
                            registry=r)
        self.epoch = Gauge("p2pserve_coordinator_plan_epoch", "Epoch of the plan this coordinator last published",
                           registry=r)
        self.seen_epoch = Gauge("p2pserve_coordinator_seen_plan_epoch",
                                "Highest plan epoch read from any trusted coordinator", registry=r)
        self.max_flow = Gauge("p2pserve_coordinator_plan_max_flow_tokens_per_second",
                              "Max-flow of the last published plan over the ranges served", registry=r)
        self.serving = Gauge("p2pserve_coordinator_plan_serving_peers", "Peers serving in the last published plan",
                             registry=r)
        self.solve_seconds = Histogram("p2pserve_coordinator_solve_seconds", "Time of one re-plan (placement and flows)",
                                       buckets=SECONDS_SOLVE, registry=r)
        self.published = Counter("p2pserve_coordinator_plans_published", "Plans published under a new epoch, by trigger",
                                 ["trigger"], registry=r)
        self.failed_rounds = Counter("p2pserve_coordinator_failed_rounds", "Coordinator rounds that raised",
                                     registry=r)


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint (prometheus-client's threaded HTTP server)."""

    host: str
    port: int
    _httpd: object
    _thread: object

    @property
    def url(self) -> str:
        """Where to scrape."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port."""
        self._httpd.shutdown()
        self._httpd.server_close()


def serve_metrics(registry: CollectorRegistry, config: MetricsConfig) -> MetricsServer:
    """Serve ``registry`` at ``http://HOST:PORT/metrics`` (any path answers) from a daemon thread.

    A thread of its own, not the role's event loop: the numbers stay readable while that loop is
    busy or stuck, which is when an operator looks. Port 0 picks a free one.
    """
    host, port = config.host, config.port
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {e}") from e
    server = MetricsServer(host, httpd.server_port, httpd, thread)
    log.info("metrics at %s", server.url)
    return server
