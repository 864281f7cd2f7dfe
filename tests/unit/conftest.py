"""Fixtures shared by the unit tests: the authors' clusters as topologies (immutable, so one
load serves every test)."""

from __future__ import annotations

import pytest

from p2pserve.helix.root import data_root
from p2pserve.helix.topology import load_helix_topology


@pytest.fixture(scope="session")
def cluster24():
    """Helix's single cluster (4 A100, 8 L4, 12 T4) for LLaMA-2-70B."""
    return load_helix_topology(data_root() / "clusters/single_cluster/cluster24.ini", "llama2-70b")


@pytest.fixture(scope="session")
def cluster10():
    """Helix's ablation cluster for LLaMA-1-30B."""
    return load_helix_topology(data_root() / "clusters/ablation/cluster10.ini", "llama1-30b")
