"""Max-flow over placements: the Helix Fig. 2 example and the authors' published placements."""

from __future__ import annotations

import pytest

from p2pserve.helix import format as hf
from p2pserve.placement.maxflow import max_flow, placement_edges
from p2pserve.helix.root import data_root
from p2pserve.helix.topology import load_helix_topology
from p2pserve.placement.topology import BandwidthConvention, LinkSpec, NodeSpec, Topology
from p2pserve.types import SINK_INDEX as SINK, SOURCE_INDEX as SOURCE


def fig2_topology(a100_t4_2_mbps: float = 60.0) -> Topology:
    """Helix Fig. 2: coordinator + A100 (layers 1-2) + T4-1 (layer 1) + T4-2 (layer 3).

    Links in Mbit/s (the figure's unit, converted properly here: bits / 8): coordinator-A100 80,
    coordinator-T4-1 20, coordinator-T4-2 40, A100-T4-2 60, A100-T4-1 90, T4-1-T4-2 50.
    Token 4 B, activation 16 KB. Node throughputs: A100 1500, T4s 1000 tokens/s. T4-1 reaches
    T4-2 only through the A100 running layer 2 (partial inference).
    """
    mbps = 1e6
    nodes = (
        NodeSpec("A100", "A100", (0.0, 3000.0, 1500.0)),
        NodeSpec("T4-1", "T4", (0.0, 1000.0)),
        NodeSpec("T4-2", "T4", (0.0, 1000.0)),
    )
    undirected = {(0, 1): 90, (0, 2): a100_t4_2_mbps, (1, 2): 50}
    links = []
    for i, bw in ((0, 80), (1, 20), (2, 40)):
        links.append(LinkSpec(SOURCE, i, bw * mbps, 1e-3))
        links.append(LinkSpec(i, SINK, bw * mbps, 1e-3))
    for (a, b), bw in undirected.items():
        links.append(LinkSpec(a, b, bw * mbps, 1e-3))
        links.append(LinkSpec(b, a, bw * mbps, 1e-3))
    return Topology(nodes, tuple(links), num_layers=3, activation_bytes=16 * 1024, token_bytes=4,
                    convention=BandwidthConvention.BITS_PER_S)


FIG2_PLACEMENT = {0: (0, 2), 1: (0, 1), 2: (2, 3)}


def test_fig2_edge_capacities():
    topo = fig2_topology()
    caps = {(u, v): c for u, v, c in placement_edges(topo, FIG2_PLACEMENT, partial=True)}
    assert caps[(SOURCE, 0)] == pytest.approx(2.5e6)  # 80 Mbps / 4 B tokens
    assert caps[(SOURCE, 1)] == pytest.approx(625e3)
    assert caps[(2, SINK)] == pytest.approx(1.25e6)
    assert caps[(0, 2)] == pytest.approx(457.76, rel=1e-3)  # 60 Mbps / 16 KB -> "458"
    assert caps[(1, 0)] == pytest.approx(686.65, rel=1e-3)  # 90 Mbps -> "687"
    assert (1, 2) not in caps  # T4-2 does not hold layer 2
    assert set(caps) == {(SOURCE, 0), (SOURCE, 1), (1, 0), (0, 2), (2, SINK)}


@pytest.mark.parametrize("engine", ["dinic", "networkx"])
def test_fig2_max_flow(engine):
    # The A100 -> T4-2 link (458 activations/s) is the cut.
    res = max_flow(fig2_topology(), FIG2_PLACEMENT, partial=True, engine=engine)
    assert res.value == pytest.approx(457.76, rel=1e-3)
    # A fast A100 -> T4-2 link: T4-2's 1000 tokens/s binds; with partial inference T4-1 feeds
    # the A100 too (687 more could arrive), without it only the A100's own source edge does.
    res = max_flow(fig2_topology(1000.0), FIG2_PLACEMENT, partial=True, engine=engine)
    assert res.value == pytest.approx(1000.0)
    assert res.edge_flows[(0, 2)] == pytest.approx(1000.0)
    nopartial = max_flow(fig2_topology(1000.0), FIG2_PLACEMENT, partial=False, engine=engine)
    assert nopartial.value == pytest.approx(1000.0)
    assert (1, 0) not in nopartial.edge_flows
    # Conservation at every compute node.
    for i in range(3):
        inflow = sum(f for (u, v), f in res.edge_flows.items() if v == i)
        outflow = sum(f for (u, v), f in res.edge_flows.items() if u == i)
        assert inflow == pytest.approx(outflow)
        assert inflow == pytest.approx(res.node_flows[i])


def test_fig2_partial_inference_adds_edge():
    caps = {(u, v) for u, v, _ in placement_edges(fig2_topology(), FIG2_PLACEMENT, partial=False)}
    assert (1, 0) not in caps  # T4-1 ends at 1, the A100 starts at 0: needs partial inference


@pytest.mark.parametrize(
    "layout,partial,expected",
    [
        ("ilp", True, 1289.56),
        ("petals", True, 952.11),
        ("swarm", True, 757.85),
    ],
)
def test_authors_placements_reproduce(layout, partial, expected):
    data = data_root()
    topo = load_helix_topology(data / "clusters/single_cluster/cluster24.ini", "llama2-70b")
    sol = hf.load_solution(next((data / "layouts/single_cluster/llama70b" / layout).glob("*_sol.ini")))
    fast = max_flow(topo, sol, partial)
    ref = max_flow(topo, sol, partial, engine="networkx")
    assert fast.value == pytest.approx(expected, abs=0.01)
    assert ref.value == pytest.approx(fast.value, rel=1e-9)


def test_cluster10_optimum_placement():
    data = data_root()
    topo = load_helix_topology(data / "clusters/ablation/cluster10.ini", "llama1-30b")
    sol = hf.load_solution(data / "layouts/ablation/quality/ilp_sol.ini")
    assert max_flow(topo, sol).value == pytest.approx(286.587, abs=1e-3)
    assert topo.upper_bound() == pytest.approx(364.51, abs=0.01)


def test_upper_bounds_cluster24():
    data = data_root()
    topo = load_helix_topology(data / "clusters/single_cluster/cluster24.ini", "llama2-70b")
    assert topo.upper_bound() == pytest.approx(2803.86, abs=0.01)
    assert topo.covering_upper_bound() <= topo.upper_bound()


def test_bandwidth_conventions():
    data = data_root()
    helix = load_helix_topology(data / "clusters/ablation/cluster10.ini", "llama1-30b")
    bits = load_helix_topology(data / "clusters/ablation/cluster10.ini", "llama1-30b", BandwidthConvention.BITS_PER_S)
    assert helix.capacity(0, 1) == pytest.approx(1e9 / 13312)
    assert bits.capacity(0, 1) == pytest.approx(1e9 / 8 / 13312)
    assert helix.capacity(SOURCE, 0) == pytest.approx(5e8)
