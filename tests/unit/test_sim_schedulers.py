"""Scheduler policies as pure functions of a stub view."""

import random
from collections import Counter

from p2pserve.sim.batching import BatchCaps, CapsPolicy, ThrottlePolicy
from p2pserve.sim.request import Query
from p2pserve.sim.schedulers import (
    IwrrScheduler,
    PetalsScheduler,
    RandomScheduler,
    ShortestQueueScheduler,
    SwarmScheduler,
)
from p2pserve.sim.topology import SINK, SOURCE

from tests.unit.test_sim_support import make_topology


class StubView:
    """A SchedulerView with fixed measurements and an optional set of masked nodes."""

    def __init__(self, topology, masked=(), queued=None, speed=None, layer_s=0.001):
        self.topology = topology
        self.masked = set(masked)
        self.queued = queued or {}
        self.speeds = speed or {}
        self.layer_s = layer_s

    def admissible(self, edge, query):
        return edge.dst not in self.masked

    def queued_tokens(self, node):
        return self.queued.get(node, 0)

    def speed(self, node):
        return self.speeds.get(node, 1.0)

    def layer_time(self, node, tokens, prompt):
        return self.layer_s


def two_parallel():
    """Nodes 0 and 1 both hold the whole 2-layer model."""
    return make_topology([(0, 2), (0, 2)], num_layers=2)


def test_iwrr_follows_flow_weights_without_bursts():
    topo = two_parallel()
    flows = {(SOURCE, 0): 3.0, (SOURCE, 1): 1.0, (0, SINK): 3.0, (1, SINK): 1.0}
    sched = IwrrScheduler(flows)
    view = StubView(topo)
    picks = [sched.route(Query(i, 100, 10, 0.0), view)[0].node for i in range(400)]
    assert Counter(picks) == {0: 300, 1: 100}
    # interleaved: never more than 4 consecutive picks of the heavy node
    run = longest = 0
    for p in picks:
        run = run + 1 if p == 0 else 0
        longest = max(longest, run)
    assert longest <= 4


def test_iwrr_decode_steps_charge_the_route():
    topo = two_parallel()
    flows = {(SOURCE, 0): 1.0, (SOURCE, 1): 1.0, (0, SINK): 1.0, (1, SINK): 1.0}
    sched = IwrrScheduler(flows)
    view = StubView(topo)
    q = Query(0, 10, 50, 0.0)
    q.route = sched.route(q, view)
    first = q.route[0].node
    for _ in range(50):
        sched.on_decode(q)  # 50 tokens on the first route
    # the next 6 prompts of 10 tokens go to the other node until loads even out
    nxt = [sched.route(Query(i, 10, 1, 0.0), view)[0].node for i in range(1, 7)]
    assert all(n != first for n in nxt)


def test_iwrr_masks_small_flows_and_masked_nodes():
    topo = two_parallel()
    flows = {(SOURCE, 0): 100.0, (SOURCE, 1): 4.0, (0, SINK): 100.0, (1, SINK): 4.0}
    sched = IwrrScheduler(flows)
    assert {sched.route(Query(i, 1, 1, 0.0), StubView(topo))[0].node for i in range(50)} == {0}
    assert sched.route(Query(99, 1, 1, 0.0), StubView(topo, masked={0})) is None


def test_walk_backs_up_from_dead_ends():
    # source -> {0: [0,1), 1: [0,1)} -> 2: [1,2) reachable only from node 1 (no link 0->2)
    from p2pserve.sim.topology import LinkSpec

    spec = LinkSpec(1e9, 0.0)
    links = {(SOURCE, 0): spec, (SOURCE, 1): spec, (1, 2): spec, (2, SINK): spec}
    topo = make_topology([(0, 1), (0, 1), (1, 2)], num_layers=2, links=links)
    flows = {(SOURCE, 0): 10.0, (SOURCE, 1): 1.0, (1, 2): 1.0, (2, SINK): 1.0}
    route = IwrrScheduler(flows).route(Query(0, 1, 1, 0.0), StubView(topo))
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
