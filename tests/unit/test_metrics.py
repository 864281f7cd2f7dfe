"""The metrics' pure parts and their owners, without processes: error codes as labels, one
registry per role instance, state gauges read at scrape time, the HTTP endpoint, and the
series the real pipeline, generation and coordinator round feed (fake peers, fake swarm)."""

from __future__ import annotations

import asyncio
import socket
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from p2pserve.client.generation import Generation
from p2pserve.client.params import GenerationParams
from p2pserve.client.pipeline import Pipeline
from p2pserve.client.route_providers import PeerListRoutes
from p2pserve.config import ClientConfig, CoordinatorConfig, DHTConfig
from p2pserve.coordinator.service import CoordinatorService
from p2pserve.dht.records import PeerInfo
from p2pserve.errors import (
    ERROR_CLASSES,
    AllRoutesOverloadedError,
    BadRequestError,
    ConfigError,
    GenerationFailedError,
    NoRouteError,
    error_from_reply,
)
from p2pserve.metrics import (
    CLIENT_CODES,
    PEER_STATE,
    ClientMetrics,
    CoordinatorMetrics,
    MetricsConfig,
    PeerMetrics,
    StateCollector,
    error_code,
    serve_metrics,
)
from p2pserve.testing import FakeClock, FakePeerNetwork, FakeSwarm, FakeSwarmStore, FixedRoutes


def samples(registry) -> dict[tuple[str, tuple], float]:
    """Every sample of a registry's exposition, parsed back: (name, sorted labels) -> value."""
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(registry, name: str, **labels) -> float:
    return samples(registry)[(name, tuple(sorted(labels.items())))]


def test_error_codes_are_the_wire_codes_or_a_fixed_few():
    for code, cls in ERROR_CLASSES.items():
        assert error_code(cls("x")) == code.value
        assert error_code(error_from_reply(code.value, "x", peer="p")) == code.value
    assert error_code(error_from_reply("made-up-by-a-hostile-peer", "x")) == "internal"
    assert error_code(NoRouteError("no")) == "no_route"
    assert error_code(NoRouteError("only load blocks it", overloaded=True)) == "all_routes_overloaded"
    assert error_code(AllRoutesOverloadedError("full")) == "all_routes_overloaded"
    assert error_code(GenerationFailedError("gave up")) == "generation_failed"
    assert error_code(TimeoutError()) == "timeout"
    assert error_code(ConnectionResetError()) == "connection"
    assert error_code(asyncio.IncompleteReadError(b"", 8)) == "connection"
    assert error_code(ValueError("anything")) == "internal"
    assert set(CLIENT_CODES).isdisjoint(c.value for c in ERROR_CLASSES)


def test_every_known_code_is_exported_at_zero():
    reg = PeerMetrics(dict).registry
    assert value(reg, "p2pserve_peer_errors_total", code="overloaded") == 0
    client = ClientMetrics().registry
    assert value(client, "p2pserve_client_hop_errors_total", code="timeout") == 0
    assert value(client, "p2pserve_client_request_errors_total", code="bad_request") == 0


def test_role_instances_in_one_process_keep_their_own_numbers():
    a, b = ClientMetrics(), ClientMetrics()
    a.tokens.inc(3)
    assert value(a.registry, "p2pserve_client_generated_tokens_total") == 3
    assert value(b.registry, "p2pserve_client_generated_tokens_total") == 0
    p, q = PeerMetrics(dict), PeerMetrics(dict)  # same names, no "duplicated timeseries" error
    p.step(tokens=5, sessions=2, seconds=0.001)
    p.step(tokens=1, sessions=1, seconds=0.001)
    p.error(BadRequestError("no"))
    reg = p.registry
    assert value(reg, "p2pserve_peer_tokens_total") == 6
    assert value(reg, "p2pserve_peer_batch_tokens_sum") == 6  # the histogram and the counter agree
    assert value(reg, "p2pserve_peer_batch_tokens_count") == 2
    assert value(reg, "p2pserve_peer_batch_sessions_bucket", le="1.0") == 1
    assert value(reg, "p2pserve_peer_errors_total", code="bad_request") == 1
    assert value(q.registry, "p2pserve_peer_tokens_total") == 0


def test_state_gauges_are_read_at_scrape_time_and_a_failing_read_spares_the_rest():
    state = {name: 0.0 for name in PEER_STATE}
    metrics = PeerMetrics(lambda: state)
    state["p2pserve_peer_kv_used_token_layers"] = 7
    state["p2pserve_peer_compute_restarts"] = 2
    assert value(metrics.registry, "p2pserve_peer_kv_used_token_layers") == 7
    assert value(metrics.registry, "p2pserve_peer_compute_restarts_total") == 2  # a count: a counter

    def broken():
        raise RuntimeError("state gone")

    reg = PeerMetrics(broken).registry
    got = samples(reg)  # the scrape still answers, without the state gauges
    assert ("p2pserve_peer_tokens_total", ()) in got
    assert not any(name == "p2pserve_peer_kv_used_token_layers" for name, _ in got)
    partial = StateCollector({"a": "A", "b": "B"}, lambda: {"a": 1})
    assert [f.name for f in partial.collect()] == ["a"]


def test_the_endpoint_serves_one_registry_and_frees_its_port():
    metrics = CoordinatorMetrics()
    metrics.epoch.set(3)
    server = serve_metrics(metrics.registry, MetricsConfig(port=0))
    try:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(server.url, timeout=10) as r:
            text = r.read().decode()
        epoch = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "p2pserve_coordinator_plan_epoch"]
        assert epoch == [3.0]
        with pytest.raises(ConfigError, match="cannot serve metrics"):
            serve_metrics(metrics.registry, MetricsConfig(port=server.port))  # in use
    finally:
        server.close()
    with socket.create_server(("127.0.0.1", server.port)):  # closed: the port is free again
        pass


def test_metrics_config_bounds():
    assert MetricsConfig().port is None and MetricsConfig().host == "127.0.0.1"
    with pytest.raises(ConfigError):
        MetricsConfig(port=70000)


def test_peer_and_coordinator_flags():
    import argparse

    from p2pserve.cli import coordinator as coordinator_cli
    from p2pserve.cli import peer as peer_cli
    from p2pserve.cli.common import metrics_config

    parser = argparse.ArgumentParser()
    peer_cli.add_arguments(parser)
    assert parser.parse_args([]).metrics_port is None  # off by default
    args = parser.parse_args(["--metrics-port", "0", "--metrics-host", "0.0.0.0"])
    assert metrics_config(args) == MetricsConfig(port=0, host="0.0.0.0")
    parser = argparse.ArgumentParser()
    coordinator_cli.add_arguments(parser)
    assert metrics_config(parser.parse_args(["--metrics-port", "9100"])) == MetricsConfig(port=9100)
    with pytest.raises(ConfigError):
        metrics_config(parser.parse_args(["--metrics-port", "70000"]))


SPANS = {"a": (0, 4), "b1": (4, 8), "b2": (4, 8)}


def test_pipeline_and_generation_feed_the_client_series():
    """A generation whose last hop dies mid-way: tokens, first token, hop times, one failover
    and the failed hop's code; then a request refused as bad counts as a failed request."""
    net = FakePeerNetwork(num_layers=8)
    hops = {p: net.add(p, *span) for p, span in SPANS.items()}
    metrics = ClientMetrics()
    config = ClientConfig(max_retries=3, stale_route_pause_s=0.0)

    def pipeline(routes) -> Pipeline:
        return Pipeline(net.client(), routes, "fake-model", 8, max_length=64, config=config, metrics=metrics)

    async def go():
        p = pipeline(PeerListRoutes(8, list(hops.values()), seed=0))  # b1 and b2: replicas of [4, 8)
        gen = Generation(p, [1, 2, 3], GenerationParams(max_new_tokens=6, ignore_eos=True), set(), metrics=metrics)
        tokens = []
        try:
            async for event in gen:
                tokens.append(event.token)
                if len(tokens) == 3:
                    net.kill(p.route[-1].peer_id)
        finally:
            await p.close()
        bad = pipeline(FixedRoutes([hops["a"], hops["b2"]]))
        net.refuse_once["a"] = "bad_request"
        with pytest.raises(BadRequestError):
            await bad.open()
        await bad.close()
        return tokens

    tokens = asyncio.run(go())
    reg = metrics.registry
    assert len(tokens) == 6
    assert value(reg, "p2pserve_client_generated_tokens_total") == 6
    assert value(reg, "p2pserve_client_time_to_first_token_seconds_count") == 1
    assert value(reg, "p2pserve_client_hop_seconds_count", kind="prefill") >= 2  # the prompt, then the replay
    assert value(reg, "p2pserve_client_hop_seconds_count", kind="decode") >= 2 * 4
    assert value(reg, "p2pserve_client_failovers_total") == 1
    assert value(reg, "p2pserve_client_hop_errors_total", code="bad_request") == 1
    assert sum(v for (name, _), v in samples(reg).items() if name == "p2pserve_client_hop_errors_total") == 2
    assert value(reg, "p2pserve_client_request_errors_total", code="bad_request") == 1
    assert sum(v for (name, _), v in samples(reg).items() if name == "p2pserve_client_request_errors_total") == 1


def test_coordinator_round_sets_leader_epoch_and_solve_time():
    store, clock = FakeSwarmStore(), FakeClock()
    cfg = DHTConfig(model="m", candidate_refresh=1.0, plan_refresh=2.0, max_clock_skew=0.0)
    coord = CoordinatorService(FakeSwarm(store, "c", cfg), CoordinatorConfig(num_layers=4, solve_time_limit=0.2),
                               clock=clock)
    x = FakeSwarm(store, "x", DHTConfig(model="m"))
    asyncio.run(x.announce_peer(PeerInfo(model="m", peer_id="x", max_layers=4, serving=(0, 4), state="serving",
                                         throughput_decode=[4.0, 3.0, 2.0, 1.0])))

    async def go():
        await coord.step()  # inside the election grace: not leading yet
        reg = coord.metrics.registry
        assert value(reg, "p2pserve_coordinator_leader") == 0
        clock.advance(2.5)
        assert (await coord.step()).startswith("published")
        assert value(reg, "p2pserve_coordinator_leader") == 1
        assert value(reg, "p2pserve_coordinator_plan_epoch") == 1
        assert value(reg, "p2pserve_coordinator_solve_seconds_count") == 1
        assert value(reg, "p2pserve_coordinator_plans_published_total", trigger="elected") == 1
        assert value(reg, "p2pserve_coordinator_plan_serving_peers") == 1
        assert value(reg, "p2pserve_coordinator_plan_max_flow_tokens_per_second") > 0

    asyncio.run(go())
