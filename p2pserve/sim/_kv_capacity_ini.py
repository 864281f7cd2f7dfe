"""Private reader for the KV capacities in a Helix ``simulator_cluster.ini``.

``p2pserve.helix.format`` reads cluster files, solutions, profiles and machine
parameters, but not the per-layout ``simulator_cluster.ini`` the authors' layout synthesiser
wrote. Only one field of it matters here: ``kv_cache_capacity`` per ``[compute_node_X]`` (token-
layer entries). For nodes holding more layers than ``machine_params.json`` tabulates (the
separate-pipelines layouts put 20 LLaMA-70B layers on an A100) it is the only source, so the
simulator reads it when a layout provides one. Kept private and minimal on purpose: if the
shared parser grows this, switch to it and delete this file.
"""

from __future__ import annotations

import configparser
import re
from pathlib import Path


def read_kv_capacities(path: str | Path, offset: int = 2) -> dict[int, int]:
    """``compute_node_X`` -> capacity, keyed by 0-based node index ``X - offset``."""
    cp = configparser.ConfigParser(interpolation=None)
    cp.optionxform = str
    if not cp.read(path):
        raise FileNotFoundError(path)
    out: dict[int, int] = {}
    for sec in cp.sections():
        m = re.fullmatch(r"compute_node_(\d+)", sec)
        if m and cp.has_option(sec, "kv_cache_capacity"):
            out[int(m.group(1)) - offset] = int(float(cp.get(sec, "kv_cache_capacity")))
    return out


def sibling_simulator_cluster(solution_path: str | Path) -> Path | None:
    """The ``simulator_cluster.ini`` the authors wrote next to a solution file, if any."""
    p = Path(solution_path)
    candidates = [p.parent / "simulator_cluster.ini"]
    if "solution_file" in p.name:
        candidates.insert(0, p.parent / p.name.replace("solution_file", "simulator_cluster"))
    for c in candidates:
        if c.is_file():
            return c
    return None
