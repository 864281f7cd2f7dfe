"""Write Helix-format cluster files from a paper's description: regions of GPU types and links.

The Helix artifact ships only the single cluster (cluster24) and the ablation cluster
(cluster10). Its paper (§5.1) describes two more settings, which :func:`geo_distributed` and
:func:`high_heterogeneity` rebuild in the same file format:

* geo-distributed: three regions of 4 A100 / 2 L4 + 8 T4 / 6 L4 + 4 T4; inside a region the
  single cluster's network; between regions 100 Mb/s and 50 ms;
* high heterogeneity: 4 A100, 6 V100, 8 L4, 10 T4, 4 2xL4, 6 2xT4, 4 4xT4 in one region.

Bandwidths are written as the authors write them (``100 * mbps`` evaluates to 1e8), and read
by :class:`~p2pserve.placement.topology.BandwidthConvention` like every other Helix file.
The coordinator (source and sink) sits in region 0: its links to nodes of other regions are
inter-region links. Node order: regions in order, types in the order given.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


@dataclass(frozen=True)
class Net:
    """One class of link, as the file writes it (``mbps`` numbers and milliseconds)."""

    mbps: int
    ms: int


LAN = Net(1000, 1)  # cluster24's every link: 1 Gbps, 1 ms
WAN = Net(100, 50)  # §5.1: inter-cluster average 100 Mb/s, 50 ms

#: §5.1 distributed setup: (region -> [(type, count)]).
GEO_REGIONS = (
    (("A100", 4),),
    (("L4", 2), ("T4", 8)),
    (("L4", 6), ("T4", 4)),
)
#: §5.1 high GPU heterogeneity: one region, 42 nodes, 7 node types (2L4 = L4x2 etc.).
HETERO_REGIONS = (
    (("A100", 4), ("V100", 6), ("L4", 8), ("T4", 10), ("L4x2", 4), ("T4x2", 6), ("T4x4", 4)),
)


def cluster_text(regions: Sequence[Sequence[tuple[str, int]]], title: str,
                 intra: Net = LAN, inter: Net = WAN) -> str:
    """The ``.ini`` text of a complete graph over ``regions`` (coordinator in region 0)."""
    types: list[str] = []
    region: list[int] = []
    for r, members in enumerate(regions):
        for gpu, count in members:
            types += [gpu] * count
            region += [r] * count
    n = len(types)
    everyone = list(range(n))
    lines = [f"# {title}", "# written by p2pserve.helix.generate from the Helix paper's §5.1 description",
             f"# intra-region links: {intra.mbps} mbps, {intra.ms} ms; inter-region: {inter.mbps} mbps, "
             f"{inter.ms} ms; coordinator (source/sink) in region 0",
             "# regions: " + "; ".join(", ".join(f"{c}x{g}" for g, c in m) for m in regions), "",
             "[NodeNames]", f"total_compute_nodes={n}", "",
             "[SourceNode]", f"connected_nodes={everyone}", "", "[SinkNode]", f"connected_nodes={everyone}", ""]
    for i, gpu in enumerate(types):
        peers = ["'source'"] + [str(j) for j in everyone if j != i] + ["'sink'"]
        lines += [f"[ComputeNode-{i}]", f"type={gpu}", f"connected_nodes=[{', '.join(peers)}]", ""]

    def link(a: str, b: str, net: Net) -> None:
        lines.extend([f"[Link-{a}-{b}]", f"bandwidth={net.mbps} * mbps", f"latency={net.ms} * MilliSec", ""])

    for i in everyone:
        link("source", str(i), intra if region[i] == 0 else inter)
    for i in everyone:
        link(str(i), "sink", intra if region[i] == 0 else inter)
    for a in everyone:
        for b in range(a + 1, n):
            link(str(a), str(b), intra if region[a] == region[b] else inter)
    return "\n".join(lines)


def geo_distributed() -> str:
    """``distributed/cluster24_geo.ini``: cluster24's GPUs split over three regions."""
    return cluster_text(GEO_REGIONS, "Helix §5.1 distributed cluster: 3 regions, 24 nodes")


def high_heterogeneity() -> str:
    """``heterogeneity/cluster42.ini``: 42 nodes of 7 types, one region."""
    return cluster_text(HETERO_REGIONS, "Helix §5.1 high GPU heterogeneity cluster: 42 nodes, 7 types")


#: Packaged file (relative to the data root's ``clusters/``) -> its generator.
GENERATED = {
    "distributed/cluster24_geo.ini": geo_distributed,
    "heterogeneity/cluster42.ini": high_heterogeneity,
}


def write_all(clusters_dir: Path) -> list[Path]:
    """(Re)write every generated cluster file under ``clusters_dir``."""
    out = []
    for rel, fn in GENERATED.items():
        path = clusters_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(fn())
        out.append(path)
    return out


if __name__ == "__main__":  # python -m p2pserve.helix.generate
    from p2pserve.helix.root import data_root

    for p in write_all(data_root() / "clusters"):
        print(p)
