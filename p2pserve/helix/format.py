"""Readers for the Helix (ASPLOS'25) artifact files: clusters, solutions, profiles, machine params.

Pure parsing, no solver, no network; where the files live is :mod:`p2pserve.helix.root`'s
business (every reader that finds its own file takes an optional data ``root``). The authors'
node-throughput formula is in :mod:`p2pserve.helix.throughput`.

Unit conventions (kept exactly as the authors use them, so that their numbers reproduce):

* bandwidth strings such as ``1000 * mbps`` evaluate to 1e9 (mbps = 1e6, gbps = 1e9, kbps = 1e3);
  the authors divide that number *directly by a size in bytes*. :class:`HelixLink.bandwidth` holds
  the evaluated number untouched; converting it to a capacity is the topology's job, where the
  convention is an explicit parameter (see ``placement.topology.BandwidthConvention``).
* latency strings such as ``1 * MilliSec`` evaluate to seconds (1e-3).
* profile csv rows are ``batch_tokens, milliseconds per ONE layer``.
"""

from __future__ import annotations

import ast
import configparser
import json
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from p2pserve.errors import ConfigError, UnknownModelError
from p2pserve.helix.root import data_root
from p2pserve.placement.profile import LatencyProfile

#: Our model names -> directory / key names in the artifact.
MODEL_DIRS: dict[str, str] = {"llama2-70b": "llama2_70b", "llama1-30b": "llama1_30b"}

_UNITS: dict[str, float] = {
    "bps": 1.0,
    "kbps": 1e3,
    "mbps": 1e6,
    "gbps": 1e9,
    "sec": 1.0,
    "millisec": 1e-3,
    "microsec": 1e-6,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
}


def parse_quantity(text: str) -> float:
    """Evaluate ``"1000 * mbps"`` / ``"1 * MilliSec"`` / ``"16 * GB"`` / ``"-1"`` to a float."""
    total = 1.0
    for part in str(text).split("*"):
        token = part.strip()
        if not token:
            raise ConfigError(f"bad quantity {text!r}")
        unit = _UNITS.get(token.lower())
        if unit is not None:
            total *= unit
        else:
            try:
                total *= float(token)
            except ValueError as exc:
                raise ConfigError(f"bad quantity {text!r}: unknown unit {token!r}") from exc
    return total


@dataclass(frozen=True)
class HelixLink:
    """An undirected link: ``bandwidth`` is the evaluated file number (1000 * mbps -> 1e9)."""

    bandwidth: float
    latency_s: float


@dataclass(frozen=True)
class HelixCluster:
    """A parsed Helix cluster ``.ini``.

    ``links`` maps ``(a, b)`` with ``a < b`` (compute node indices) to the undirected link;
    ``source_links[i]`` / ``sink_links[i]`` are the links between the coordinator and node ``i``.
    """

    num_nodes: int
    node_types: list[str]
    source_connected: list[int]
    sink_connected: list[int]
    links: dict[tuple[int, int], HelixLink]
    source_links: dict[int, HelixLink] = field(default_factory=dict)
    sink_links: dict[int, HelixLink] = field(default_factory=dict)
    name: str = ""

    def link(self, a: int, b: int) -> HelixLink | None:
        """The link between compute nodes ``a`` and ``b`` (either order), or None."""
        return self.links.get((a, b) if a < b else (b, a))


def _read_ini(path: Path) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(interpolation=None)
    cp.optionxform = str  # keep key case
    if not cp.read(path):
        raise ConfigError(f"cannot read {path}")
    return cp


def _int_list(text: str) -> list:
    value = ast.literal_eval(text.strip())
    return list(value)


def load_cluster(path: str | os.PathLike) -> HelixCluster:
    """Parse a Helix cluster file (``[NodeNames]``, ``[ComputeNode-i]``, ``[Link-a-b]``)."""
    path = Path(path)
    cp = _read_ini(path)
    try:
        n = cp.getint("NodeNames", "total_compute_nodes")
    except (configparser.Error, ValueError) as exc:
        raise ConfigError(f"{path}: missing [NodeNames] total_compute_nodes") from exc
    types = []
    for i in range(n):
        sec = f"ComputeNode-{i}"
        if not cp.has_section(sec):
            raise ConfigError(f"{path}: missing section [{sec}]")
        types.append(cp.get(sec, "type").strip())
    src = [int(x) for x in _int_list(cp.get("SourceNode", "connected_nodes", fallback="[]"))]
    snk = [int(x) for x in _int_list(cp.get("SinkNode", "connected_nodes", fallback="[]"))]
    links: dict[tuple[int, int], HelixLink] = {}
    src_links: dict[int, HelixLink] = {}
    snk_links: dict[int, HelixLink] = {}
    for sec in cp.sections():
        m = re.fullmatch(r"Link-(\w+)-(\w+)", sec)
        if not m:
            continue
        link = HelixLink(parse_quantity(cp.get(sec, "bandwidth")), parse_quantity(cp.get(sec, "latency")))
        a, b = m.group(1), m.group(2)
        if a == "source":
            src_links[int(b)] = link
        elif b == "sink":
            snk_links[int(a)] = link
        else:
            ia, ib = int(a), int(b)
            links[(min(ia, ib), max(ia, ib))] = link
    return HelixCluster(n, types, src, snk, links, src_links, snk_links, name=path.stem)


def load_solution(path: str | os.PathLike) -> dict[int, tuple[int, int]]:
    """Parse a ``*_sol.ini``: compute node index (0-based, offset removed) -> [start, end)."""
    cp = _read_ini(Path(path))
    offset = cp.getint("Settings", "offset", fallback=2)
    out: dict[int, tuple[int, int]] = {}
    for key, value in cp.items("Solution"):
        m = re.fullmatch(r"compute_node_(\d+)", key)
        if not m:
            continue
        layers = sorted(int(x) for x in _int_list(value))
        if not layers:
            continue
        if layers != list(range(layers[0], layers[-1] + 1)):
            raise ConfigError(f"{path}: {key} holds non-contiguous layers {layers}")
        out[int(m.group(1)) - offset] = (layers[0], layers[-1] + 1)
    return out


def _model_dir(model: str) -> str:
    if model in MODEL_DIRS:
        return MODEL_DIRS[model]
    if model in MODEL_DIRS.values():
        return model
    raise UnknownModelError(f"unknown model {model!r}; expected one of {sorted(MODEL_DIRS)}")


def _read_csv(path: Path) -> tuple[tuple[float, ...], tuple[float, ...]]:
    xs, ys = [], []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        a, b = line.split(",")[:2]
        xs.append(float(a))
        ys.append(float(b))
    return tuple(xs), tuple(ys)


@lru_cache(maxsize=None)
def _load_profile_cached(model_dir: str, gpu: str, data_dir: str) -> LatencyProfile:
    base = Path(data_dir) / "profiles" / model_dir / gpu
    if not base.is_dir():
        raise ConfigError(f"no profile for GPU type {gpu!r} and model {model_dir!r} in {base}")
    px, py = _read_csv(base / "prompt_bs2time.csv")
    dx, dy = _read_csv(base / "decode_bs2time.csv")
    return LatencyProfile(px, py, dx, dy)


def load_profile(model: str, gpu_type: str, root: Path | None = None) -> LatencyProfile:
    """Latency profile of ``gpu_type`` (``A100``/``a100``, ``L4``, ``T4x2``...) for ``model``."""
    return _load_profile_cached(_model_dir(model), gpu_type.lower(), str(root or data_root()))


@dataclass(frozen=True)
class GpuParams:
    """Per GPU type, per model limits from ``machine_params.json`` (dicts keyed by #layers k)."""

    name: str
    max_num_layers: int
    vllm_num_blocks: dict[int, int]
    prompt_max_requests: dict[int, int]
    decode_max_tokens: dict[int, int]


@dataclass(frozen=True)
class MachineParams:
    """Typed view of ``profiles/machine_params.json`` for one model."""

    model: str
    num_layers: int
    token_size_bytes: int
    activation_size_bytes: int
    layer_param_bytes: float
    gpus: dict[str, GpuParams]  # keyed by upper-case type name ("A100", "L4x2" as in the file)
    typical_layers_default: dict[str, int]
    typical_layers_small: dict[str, int]  # the "if capacity below 1.2 L" table
    initial_normalized_perf: dict[str, float]
    avg_input_len: int = 750
    avg_output_len: int = 240
    max_input_len: int = 2048
    block_size: int = 16
    kv_cache_hwm: float = 0.3
    decode_per_token_max_context: int = 1000

    def gpu(self, gpu_type: str) -> GpuParams:
        """Parameters of ``gpu_type`` (case-insensitive)."""
        for name, params in self.gpus.items():
            if name.lower() == gpu_type.lower():
                return params
        raise ConfigError(f"GPU type {gpu_type!r} has no machine params for {self.model}")

    def kv_capacity(self, gpu_type: str, k: int) -> int:
        """Token-layer KV entries a node holding ``k`` layers can store: 16 * blocks[k] * k."""
        return self.block_size * self.gpu(gpu_type).vllm_num_blocks[k] * k

    def prompt_max_tokens(self, gpu_type: str, k: int) -> int:
        """Largest prompt batch: prompt_max_requests[k] * MAX_INPUT_LEN."""
        return self.gpu(gpu_type).prompt_max_requests[k] * self.max_input_len


def canonical_type(name: str, table: dict) -> str:
    """The key of ``table`` naming GPU type ``name``, whatever its case (``a100`` -> ``A100``)."""
    for key in table:
        if key.lower() == name.lower():
            return key
    raise ConfigError(f"GPU type {name!r} not in {sorted(table)}")


def load_machine_params(model: str, root: Path | None = None) -> MachineParams:
    """Read ``profiles/machine_params.json`` for ``model`` (``llama2-70b`` / ``llama1-30b``)."""
    mdir = _model_dir(model)
    raw = json.loads(((root or data_root()) / "profiles" / "machine_params.json").read_text())
    section = raw[mdir]
    consts = raw.get("_constants", {})
    meta = section["_model"]
    gpus = {}
    for key, val in section.items():
        if key.startswith("_"):
            continue
        gpus[val["machine_name"]] = GpuParams(
            name=val["machine_name"],
            max_num_layers=int(val["max_num_layers"]),
            vllm_num_blocks={int(k): int(v) for k, v in val["vllm_num_blocks"].items()},
            prompt_max_requests={int(k): int(v) for k, v in val["prompt_max_requests"].items()},
            decode_max_tokens={int(k): int(v) for k, v in val["decode_max_tokens"].items()},
        )
    return MachineParams(
        model=model,
        num_layers=int(meta["num_layers"]),
        token_size_bytes=int(meta["token_size_bytes"]),
        activation_size_bytes=int(meta["activation_size_bytes"]),
        layer_param_bytes=float(meta["layer_param_bytes"]),
        gpus=gpus,
        typical_layers_default=dict(meta["typical_layers_default"]),
        typical_layers_small=dict(meta["typical_layers_if_capacity_below_1.2L"]),
        initial_normalized_perf={k: float(v) for k, v in meta["initial_normalized_perf"].items()},
        avg_input_len=int(consts.get("AVG_INPUT_LEN", 750)),
        avg_output_len=int(consts.get("AVG_OUTPUT_LEN", 240)),
        max_input_len=int(consts.get("MAX_INPUT_LEN", 2048)),
        block_size=int(consts.get("VLLM_BLOCK_SIZE", 16)),
        kv_cache_hwm=float(consts.get("KV_CACHE_HWM", 0.3)),
        decode_per_token_max_context=int(consts.get("DECODE_PER_TOKEN_MAX_CONTEXT", 1000)),
    )


def load_machine_profiles(root: Path | None = None) -> dict[str, dict[str, float]]:
    """``machine_profiles.ini``: type -> {inbound_nic_speed, outbound_nic_speed, vram_size} (evaluated)."""
    path = (root or data_root()) / "clusters" / "single_cluster" / "machine_profiles.ini"
    cp = _read_ini(path)
    return {sec: {k: parse_quantity(v) for k, v in cp.items(sec)} for sec in cp.sections()}


def vram_bytes(gpu_type: str, root: Path | None = None) -> float:
    """VRAM of a GPU type from ``machine_profiles.ini`` (e.g. T4 16 GB -> 16e9)."""
    profiles = load_machine_profiles(root)
    for name, vals in profiles.items():
        if name.lower() == gpu_type.lower():
            return vals["vram_size"]
    raise ConfigError(f"GPU type {gpu_type!r} has no VRAM entry in machine_profiles.ini")


def read_kv_capacities(path: str | os.PathLike, offset: int = 2) -> dict[int, int]:
    """KV capacity per node from a layout's ``simulator_cluster.ini``.

    The authors' layout synthesiser wrote one next to each solution; only ``kv_cache_capacity``
    per ``[compute_node_X]`` (token-layer entries) is read. For nodes holding more layers than
    ``machine_params.json`` tabulates (the separate-pipelines layouts put 20 LLaMA-70B layers on
    an A100) it is the only source. Keys are 0-based node indices ``X - offset``.
    """
    cp = _read_ini(Path(path))
    out: dict[int, int] = {}
    for sec in cp.sections():
        m = re.fullmatch(r"compute_node_(\d+)", sec)
        if m and cp.has_option(sec, "kv_cache_capacity"):
            out[int(m.group(1)) - offset] = int(float(cp.get(sec, "kv_cache_capacity")))
    return out


def sibling_simulator_cluster(solution_path: str | os.PathLike) -> Path | None:
    """The ``simulator_cluster.ini`` the authors wrote next to a solution file, if any."""
    p = Path(solution_path)
    candidates = [p.parent / "simulator_cluster.ini"]
    if "solution_file" in p.name:
        candidates.insert(0, p.parent / p.name.replace("solution_file", "simulator_cluster"))
    for c in candidates:
        if c.is_file():
            return c
    return None
