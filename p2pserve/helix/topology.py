"""A Helix cluster file as the planner's :class:`~p2pserve.placement.topology.Topology`.

Node throughput comes from the authors' formula (:mod:`p2pserve.helix.throughput`), KV
capacities and batch caps from ``machine_params.json``, VRAM from ``machine_profiles.ini`` and
per-layer latency from the csv profiles. Links keep the file's bandwidth number; the
topology's :class:`~p2pserve.placement.topology.BandwidthConvention` (the authors' by default)
says how to read it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from p2pserve.errors import ConfigError
from p2pserve.helix import format as hf
from p2pserve.helix.throughput import node_throughput_tables
from p2pserve.placement.topology import BandwidthConvention, LinkSpec, NodeSpec, Topology
from p2pserve.types import SINK_INDEX, SOURCE_INDEX

#: A link the cluster file leaves out between the coordinator and a node it lists as connected.
DEFAULT_LINK = hf.HelixLink(bandwidth=1e9, latency_s=1e-3)


def helix_node_spec(
    name: str, gpu_type: str, throughput: Sequence[float], model: str, root: Path | None = None
) -> NodeSpec:
    """A :class:`NodeSpec` for a Helix GPU type, with KV capacity, batch caps and profile."""
    mp = hf.load_machine_params(model, root)
    gp = mp.gpu(gpu_type)
    kmax = len(throughput) - 1
    kv = tuple([0] + [mp.kv_capacity(gpu_type, k) for k in range(1, kmax + 1)])
    dmax = tuple([0] + [gp.decode_max_tokens[k] for k in range(1, kmax + 1)])
    preq = tuple([0] + [gp.prompt_max_requests[k] for k in range(1, kmax + 1)])
    try:
        mem = hf.vram_bytes(gpu_type, root)
    except ConfigError:
        mem = kmax * mp.layer_param_bytes
    return NodeSpec(
        name=name,
        gpu_type=gpu_type,
        throughput=tuple(float(x) for x in throughput),
        memory_bytes=mem,
        kv_capacity=kv,
        decode_max_tokens=dmax,
        profile=hf.load_profile(model, gpu_type, root),
        prompt_max_requests=preq,
    )


def _links(cluster: hf.HelixCluster) -> list[LinkSpec]:
    """Both directions of every undirected link, plus the coordinator's source and sink links."""
    links: list[LinkSpec] = []
    for i in cluster.source_connected:
        l = cluster.source_links.get(i, DEFAULT_LINK)
        links.append(LinkSpec(SOURCE_INDEX, i, l.bandwidth, l.latency_s))
    for i in cluster.sink_connected:
        l = cluster.sink_links.get(i, DEFAULT_LINK)
        links.append(LinkSpec(i, SINK_INDEX, l.bandwidth, l.latency_s))
    for (a, b), l in sorted(cluster.links.items()):
        links.append(LinkSpec(a, b, l.bandwidth, l.latency_s))
        links.append(LinkSpec(b, a, l.bandwidth, l.latency_s))
    return links


def topology_from_helix(
    cluster: hf.HelixCluster,
    model: str,
    convention: BandwidthConvention = BandwidthConvention.HELIX,
    throughput: list[list[float]] | None = None,
    root: Path | None = None,
) -> Topology:
    """Build a :class:`Topology` from a parsed Helix cluster file.

    ``throughput`` defaults to the authors' formula (:func:`node_throughput_tables`);
    ``convention`` defaults to theirs so that their numbers reproduce.
    """
    mp = hf.load_machine_params(model, root)
    tables = throughput if throughput is not None else node_throughput_tables(cluster, model, root)
    nodes = tuple(
        helix_node_spec(f"ComputeNode-{i}", cluster.node_types[i], tables[i], model, root)
        for i in range(cluster.num_nodes)
    )
    return Topology(
        nodes=nodes,
        links=tuple(_links(cluster)),
        num_layers=mp.num_layers,
        activation_bytes=mp.activation_size_bytes,
        token_bytes=mp.token_size_bytes,
        convention=convention,
        layer_bytes=mp.layer_param_bytes,
        model=model,
        name=cluster.name,
    )


def load_helix_topology(
    path: str | os.PathLike,
    model: str,
    convention: BandwidthConvention = BandwidthConvention.HELIX,
    root: Path | None = None,
) -> Topology:
    """Parse a Helix cluster ``.ini`` and build its :class:`Topology` in one call."""
    return topology_from_helix(hf.load_cluster(path), model, convention, root=root)
