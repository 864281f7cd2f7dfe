"""Layer moves between placements: what a node must newly load, counted by node name.

A re-placement costs the layers nodes must load that they do not hold yet (kept layers are
free). Nodes are identified by *name* across topologies, because indices shift when nodes
leave; :func:`by_name` / :func:`by_index` convert between the two keyings.
"""

from __future__ import annotations

from typing import Mapping

from p2pserve.placement.topology import Topology

#: node name -> [start, end)
NamedPlacement = dict[str, tuple[int, int]]


def new_layer_count(old: tuple[int, int] | None, s: int, e: int) -> int:
    """Layers a node holding ``old`` (or nothing) must load to hold ``[s, e)``."""
    if old is None:
        return e - s
    return (e - s) - max(0, min(e, old[1]) - max(s, old[0]))


def new_layers(old: Mapping[int, tuple[int, int]], i: int, s: int, e: int) -> int:
    """Layers node ``i`` must newly load to hold ``[s, e)``, given ``old`` = {node: range held now}."""
    return new_layer_count(old.get(i), s, e) if e > s else 0


def layers_to_load(old: Mapping[str, tuple[int, int]], new: Mapping[str, tuple[int, int]]) -> int:
    """Layers nodes must newly load to go from ``old`` to ``new`` (kept layers are free)."""
    return sum(new_layer_count(old.get(name), s, e) for name, (s, e) in new.items())


def by_name(topo: Topology, placement: Mapping[int, tuple[int, int]]) -> NamedPlacement:
    """Index placement -> name placement."""
    return {topo.nodes[i].name: r for i, r in placement.items()}


def by_index(topo: Topology, named: Mapping[str, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """Name placement -> index placement (names not in ``topo`` are dropped)."""
    idx = {n.name: i for i, n in enumerate(topo.nodes)}
    return {idx[name]: r for name, r in named.items() if name in idx}
