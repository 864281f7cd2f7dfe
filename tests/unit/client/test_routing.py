"""IWRR routing over a plan's flows: distribution (chi-square), masks, fallback, errors."""

from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import pytest

from p2pserve.client.routing import IWRR, Masks, NoRouteError, RouteGraph, Router, quantize, route_exists
from p2pserve.errors import RoutingError

# A:[0,4) B:[0,6) C:[4,8) D:[3,8) — partial inference: B->C runs [6,8), A->D runs [4,8).
SPANS = {"A": (0, 4), "B": (0, 6), "C": (4, 8), "D": (3, 8)}
FLOWS = {
    ("source", "A"): 30.0, ("source", "B"): 10.0,
    ("A", "C"): 20.0, ("A", "D"): 10.0, ("B", "C"): 5.0, ("B", "D"): 5.0,
    ("C", "sink"): 25.0, ("D", "sink"): 15.0,
}
# per-vertex choices are independent, so a path's share is the product of its edges' shares
EXPECTED = {("A", "C"): 0.5, ("A", "D"): 0.25, ("B", "C"): 0.125, ("B", "D"): 0.125}


def graph(flows=FLOWS, spans=SPANS) -> RouteGraph:
    return RouteGraph(num_layers=8, spans=spans, flows=flows, maddrs={p: (f"/ip4/127.0.0.1/tcp/1/p2p/{p}",) for p in spans})


def chi_square_p(observed: list[int], expected: list[float]) -> float:
    """p-value of Pearson's chi-square (scipy if installed, else the statistic vs critical values)."""
    try:
        from scipy.stats import chisquare

        return float(chisquare(observed, expected).pvalue)
    except ImportError:  # pragma: no cover - scipy is installed here
        stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
        critical_001 = {1: 6.63, 2: 9.21, 3: 11.34, 4: 13.28, 5: 15.09}[len(observed) - 1]
        return 1.0 if stat < critical_001 else 0.0


def test_iwrr_cycle_gives_exact_weights_interleaved():
    s = IWRR({"a": 3, "b": 1, "c": 2}, random.Random(0))
    picks = [s.pick(lambda c: True) for _ in range(6 * 10)]
    assert Counter(picks) == {"a": 30, "b": 10, "c": 20}
    # interleaved: never three "a" in a row (a burst-free schedule)
    assert "a,a,a" not in ",".join(picks)


def test_iwrr_skips_masked_slots_and_keeps_relative_weights():
    s = IWRR({"a": 3, "b": 1, "c": 2}, random.Random(1))
    picks = [s.pick(lambda c: c != "a") for _ in range(30)]
    assert Counter(picks) == {"c": 20, "b": 10}
    assert s.pick(lambda c: False) is None


def test_quantize():
    assert quantize({"a": 2.0, "b": 1.0, "c": 0.0}, 10) == {"a": 10, "b": 5}
    assert quantize({"a": 1000.0, "b": 0.001}, 10) == {"a": 10, "b": 1}  # a small flow stays usable
    assert quantize({}, 10) == {}


@pytest.mark.parametrize("clients,per_client", [(10_000, 1), (100, 100), (1, 10_000)])
def test_10000_routes_follow_the_flows_chi_square(clients, per_client):
    g = graph()
    counts: Counter = Counter()
    for seed in range(clients):
        router = Router(g, seed=seed)
        for _ in range(per_client):
            counts[tuple(router.route_ids())] += 1
    assert sum(counts.values()) == 10_000
    assert set(counts) == set(EXPECTED)
    keys = sorted(EXPECTED)
    p = chi_square_p([counts[k] for k in keys], [EXPECTED[k] * 10_000 for k in keys])
    assert p > 0.01, (counts, p)


def test_edge_usage_matches_flows():
    """Every edge's share of routes equals its flow over the total flow."""
    router, total = Router(graph(), seed=7), 10_000
    edges: Counter = Counter()
    for _ in range(total):
        path = ["source"] + router.route_ids() + ["sink"]
        edges.update(zip(path, path[1:]))
    for edge, rate in FLOWS.items():
        assert abs(edges[edge] / total - rate / 40.0) < 0.01, edge


def test_hops_use_partial_inference_from_where_the_previous_stopped():
    router = Router(graph(flows={("source", "B"): 1, ("B", "D"): 1, ("D", "sink"): 1}), seed=0)
    hops = router.route()
    assert [(h.peer_id, h.start, h.end) for h in hops] == [("B", 0, 6), ("D", 6, 8)]
    assert hops[0].maddrs == ("/ip4/127.0.0.1/tcp/1/p2p/B",)


def test_masks_ban_overloaded_and_kv():
    router = Router(graph(), seed=3)
    for _ in range(200):
        assert "A" not in router.route_ids(Masks(banned=frozenset({"A"})))
        assert "C" not in router.route_ids(Masks(overloaded=frozenset({"C"})))
        assert "D" not in router.route_ids(Masks(kv_free_tokens={"D": 10, "C": 10_000}, kv_need_tokens=100))
    # a peer that announced nothing is not KV-masked; need 0 masks nothing
    assert Masks(kv_free_tokens={}, kv_need_tokens=100).reason("A") is None
    assert Masks(kv_free_tokens={"A": 0}, kv_need_tokens=0).reason("A") is None


def test_masked_flow_edges_fall_back_to_any_valid_edge():
    # the plan only routes A->C; C is banned; D still connects (the plan predates the failure)
    router = Router(graph(flows={("source", "A"): 1, ("A", "C"): 1, ("C", "sink"): 1}), seed=0)
    assert router.route_ids(Masks(banned=frozenset({"C"}))) == ["A", "D"]


def test_backtracks_out_of_dead_ends():
    # only B->C reaches the sink once D is banned; A's only flow goes to D
    flows = {("source", "A"): 100, ("source", "B"): 1, ("A", "D"): 100, ("B", "C"): 1, ("C", "sink"): 1, ("D", "sink"): 100}
    spans = {"A": (0, 3), "B": (0, 6), "C": (6, 8), "D": (3, 8)}
    router = Router(graph(flows=flows, spans=spans), seed=0)
    for _ in range(50):
        assert router.route_ids(Masks(banned=frozenset({"D"}))) == ["B", "C"]


def test_no_route_errors_say_why():
    router = Router(graph(), seed=0)
    with pytest.raises(NoRouteError) as e:
        router.route_ids(Masks(banned=frozenset({"C", "D"})))
    assert isinstance(e.value, RoutingError)
    assert not e.value.overloaded
    assert "layer 6" in str(e.value) or "layer" in str(e.value)
    assert e.value.reasons == {"C": "banned", "D": "banned"}
    with pytest.raises(NoRouteError) as e:
        router.route_ids(Masks(overloaded=frozenset({"C", "D"})))
    assert e.value.overloaded
    with pytest.raises(NoRouteError):
        Router(RouteGraph(num_layers=8, spans={}), seed=0).route_ids()


def test_no_plan_graph_prefers_long_hops():
    g = RouteGraph.from_peers(8, [("full", 0, 8, ()), ("a", 0, 4, ()), ("b", 4, 8, ())])
    assert route_exists(g, Masks())
    counts = Counter(tuple(Router(g, seed=s).route_ids()) for s in range(1200))
    # source->full weighs 8, source->a weighs 4: two thirds of routes take one hop
    assert set(counts) == {("full",), ("a", "b"), ("a", "full")}
    assert abs(counts[("full",)] / 1200 - 2 / 3) < 0.05
    assert Router(g, seed=0).route_ids(Masks(banned=frozenset({"full"}))) == ["a", "b"]


def test_from_plan_record():
    plan = SimpleNamespace(
        num_layers=8, spans=SPANS,
        flows=[SimpleNamespace(src=u, dst=v, rate=r) for (u, v), r in FLOWS.items()],
    )
    g = RouteGraph.from_plan(plan, maddrs={"A": ["/x"]})
    assert g.flows == FLOWS and g.maddrs["A"] == ("/x",)


def test_clients_seeded_differently_start_differently():
    firsts = {tuple(Router(graph(), seed=s).route_ids()) for s in range(20)}
    assert len(firsts) > 1
