"""Scheduler policies as pure functions of a stub view."""

import random
from collections import Counter

from p2pserve.client.routing import RouteGraph, Router
from p2pserve.sim.batching import BatchCaps, CapsPolicy, ThrottlePolicy
from p2pserve.sim.request import Query
from p2pserve.sim.schedulers import (
    IwrrScheduler,
    PetalsScheduler,
    RandomScheduler,
    ShortestQueueScheduler,
    SwarmScheduler,
)
from p2pserve.sim.schedulers.iwrr import routable_flows
from p2pserve import types
from p2pserve.types import SINK_INDEX as SINK, SOURCE_INDEX as SOURCE

from tests.support.sim import make_topology


def name(i: int) -> str:
    """A client's name for plan vertex ``i``."""
    return types.SOURCE if i == SOURCE else types.SINK if i == SINK else f"p{i}"


class StubView:
    """A SchedulerView with fixed measurements and an optional set of masked nodes."""

    def __init__(self, graph, masked=(), queued=None, speed=None, layer_s=0.001):
        self.graph = graph
        self.masked = set(masked)
        self.queued = queued or {}
        self.speeds = speed or {}
        self.layer_s = layer_s

    def admissible(self, stage, query):
        return stage.node not in self.masked

    def queued_tokens(self, node):
        return self.queued.get(node, 0)

    def speed(self, node):
        return self.speeds.get(node, 1.0)

    def layer_time(self, node, tokens, prompt):
        return self.layer_s


def two_parallel():
    """Nodes 0 and 1 both hold the whole 2-layer model."""
    return make_topology([(0, 2), (0, 2)], num_layers=2)


def test_iwrr_follows_flow_weights():
    # The client router quantises 3:1 to weights 100:33; each cycle of 133 routes holds exactly
    # that many of each.
    topo = two_parallel()
    flows = {(SOURCE, 0): 3.0, (SOURCE, 1): 1.0, (0, SINK): 3.0, (1, SINK): 1.0}
    sched = IwrrScheduler(flows, topo, seed=0)
    view = StubView(topo)
    picks = [sched.route(Query(i, 100, 10, 0.0), view)[0].node for i in range(3 * 133)]
    assert Counter(picks) == {0: 300, 1: 99}


def test_iwrr_is_the_client_router():
    """The simulator's IWRR and a client's Router, same plan and seed: the very same routes."""
    # Partial inference: node 3 may follow node 0 mid-range, node 4 follows node 1 or 2.
    ranges = [(0, 3), (0, 2), (0, 2), (2, 6), (2, 6)]
    topo = make_topology(ranges, num_layers=6)
    flows = {(SOURCE, 0): 5.0, (SOURCE, 1): 3.0, (SOURCE, 2): 2.0, (0, 3): 5.0, (1, 4): 3.0, (2, 3): 1.0,
             (2, 4): 1.0, (3, SINK): 6.0, (4, SINK): 4.0}
    sched = IwrrScheduler(flows, topo, seed=42)
    view = StubView(topo)
    sim_routes = [tuple(st.node for st in sched.route(Query(i, 100, 10, 0.0), view)) for i in range(1000)]
    graph = RouteGraph(num_layers=6, spans={f"p{i}": r for i, r in enumerate(ranges)},
                       flows={(name(u), name(v)): f for (u, v), f in flows.items()})
    router = Router(graph, seed=42)
    client_routes = [tuple(int(p[1:]) for p in router.route_ids()) for _ in range(1000)]
    assert sim_routes == client_routes
    assert Counter(sim_routes) == Counter(client_routes)  # the distribution, for the record
    assert set(sim_routes) == {(0, 3), (1, 4), (2, 3), (2, 4)}


def test_iwrr_matches_the_client_router_on_the_authors_plan():
    """Cluster24, LLaMA-2-70B, the authors' Helix placement and its max-flow: identical route
    counts over 2,000 requests (flows under Helix's 5 % share dropped on both sides)."""
    from p2pserve.helix.root import data_root
    from p2pserve.sim.scenario import build_scenario, helix_part

    data = data_root()
    sc = build_scenario("llama2-70b", [helix_part(data / "clusters/single_cluster/cluster24.ini",
                                                  data / "layouts/single_cluster/llama70b/ilp/ilp_sol.ini")])
    sched = IwrrScheduler(sc.flows, sc.graph, seed=7)
    view = StubView(sc.graph)
    sim_counts = Counter(tuple(st.node for st in sched.route(Query(i, 500, 10, 0.0), view)) for i in range(2000))
    flows = routable_flows(sc.flows)
    graph = RouteGraph(num_layers=sc.graph.num_layers,
                       spans={f"p{i}": (a.start, a.end) for i, a in sc.graph.assignments.items()},
                       flows={(name(u), name(v)): f for (u, v), f in flows.items()})
    router = Router(graph, seed=7)
    client_counts = Counter(tuple(int(p[1:]) for p in router.route_ids()) for _ in range(2000))
    assert sim_counts == client_counts
    assert len(sim_counts) >= 8  # the flows split over several pipelines (8 with this seed)


def test_iwrr_masks_small_flows_and_masked_nodes():
    topo = two_parallel()
    flows = {(SOURCE, 0): 100.0, (SOURCE, 1): 4.0, (0, SINK): 100.0, (1, SINK): 4.0}
    sched = IwrrScheduler(flows, topo)
    assert {sched.route(Query(i, 1, 1, 0.0), StubView(topo))[0].node for i in range(50)} == {0}
    assert sched.route(Query(99, 1, 1, 0.0), StubView(topo, masked={0})) is None


def test_iwrr_waits_rather_than_leave_the_flows():
    # Flows use only node 0; node 1 could serve too, but a Helix coordinator holds the query
    # until a flow route frees up (the client router alone would fall back to node 1).
    topo = two_parallel()
    flows = {(SOURCE, 0): 1.0, (0, SINK): 1.0}
    sched = IwrrScheduler(flows, topo)
    assert sched.route(Query(0, 1, 1, 0.0), StubView(topo, masked={0})) is None
    assert [st.node for st in sched.route(Query(1, 1, 1, 0.0), StubView(topo))] == [0]


def test_walk_backs_up_from_dead_ends():
    # source -> {0: [0,1), 1: [0,1)} -> 2: [1,2) reachable only from node 1 (no link 0->2)
    links = [(SOURCE, 0), (SOURCE, 1), (1, 2), (2, SINK)]
    topo = make_topology([(0, 1), (0, 1), (1, 2)], num_layers=2, bandwidth=1e9, latency=0.0, links=links)
    flows = {(SOURCE, 0): 10.0, (SOURCE, 1): 1.0, (1, 2): 1.0, (2, SINK): 1.0}
    route = IwrrScheduler(flows, topo).route(Query(0, 1, 1, 0.0), StubView(topo))
    assert [st.node for st in route] == [1, 2]


def test_random_is_seeded_and_roughly_uniform():
    topo = two_parallel()
    a = [RandomScheduler(random.Random(3)).route(Query(i, 1, 1, 0.0), StubView(topo))[0].node for i in range(5)]
    s1, s2 = RandomScheduler(random.Random(3)), RandomScheduler(random.Random(3))
    v = StubView(topo)
    assert [s1.route(Query(i, 1, 1, 0.0), v)[0].node for i in range(100)] == [
        s2.route(Query(i, 1, 1, 0.0), v)[0].node for i in range(100)
    ]
    counts = Counter(s1.route(Query(i, 1, 1, 0.0), v)[0].node for i in range(2000))
    assert 850 < counts[0] < 1150 and a  # uniform within noise


def test_shortest_queue_picks_least_loaded():
    topo = two_parallel()
    sched = ShortestQueueScheduler(random.Random(0))
    assert sched.route(Query(0, 1, 1, 0.0), StubView(topo, queued={0: 500, 1: 20}))[0].node == 1
    assert sched.route(Query(1, 1, 1, 0.0), StubView(topo, queued={0: 5, 1: 20}))[0].node == 0


def test_swarm_is_proportional_to_measured_speed():
    topo = two_parallel()
    sched = SwarmScheduler(random.Random(1))
    view = StubView(topo, speed={0: 9.0, 1: 1.0})
    counts = Counter(sched.route(Query(i, 1, 1, 0.0), view)[0].node for i in range(3000))
    assert 0.86 < counts[0] / 3000 < 0.94


def test_swarm_greedy_takes_the_fastest_and_breaks_ties_at_random():
    topo = two_parallel()
    sched = SwarmScheduler(random.Random(1), greedy=True)
    fast = StubView(topo, speed={0: 9.0, 1: 1.0})
    assert {sched.route(Query(i, 1, 1, 0.0), fast)[0].node for i in range(50)} == {0}
    tie = StubView(topo, speed={0: 5.0, 1: 5.0})
    assert {sched.route(Query(i, 1, 1, 0.0), tie)[0].node for i in range(50)} == {0, 1}


def test_petals_takes_the_lowest_latency_route():
    # a one-hop route through node 0 (2 layers) versus two hops 1 -> 2; node 0 is backed up.
    topo = make_topology([(0, 2), (0, 1), (1, 2)], num_layers=2, latency=0.001)
    sched = PetalsScheduler()
    idle = StubView(topo, layer_s=0.01)
    assert [st.node for st in sched.route(Query(0, 1, 1, 0.0), idle)] == [0]  # fewer link hops
    busy = StubView(topo, layer_s=0.01, queued={0: 1000}, speed={0: 1000.0, 1: 1000.0, 2: 1000.0})
    assert [st.node for st in sched.route(Query(1, 1, 1, 0.0), busy)] == [1, 2]


def test_token_throttling_formulas():
    caps = BatchCaps(prompt_max_requests=3, prompt_max_tokens=6144, decode_max_tokens=480)
    assert CapsPolicy().limits(caps, 10_000, 0.5, 100, 4) == (3, 6144, 480)
    pol = ThrottlePolicy()  # T=8, MaxP=2048, MinP=32, KVthresh=0.05
    # #P = max(min(WP/T, MaxP*(free-thr)/(1-thr)), MinP); #D = ceil(RD/depth)
    req, ptok, dec = pol.limits(caps, 8000, 1.0, 100, 8.0)
    assert (req, ptok, dec) == (3, 1000, 13)
    _, ptok, _ = pol.limits(caps, 8000, 0.24, 100, 8.0)  # KV nearly full: 2048*0.19/0.95
    assert ptok == int(2048 * 0.19 / 0.95)
    _, ptok, dec = pol.limits(caps, 10, 0.01, 0, 1.0)  # floor MinP; at least one decode
    assert ptok == 32 and dec == 1
