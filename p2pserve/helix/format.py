"""Readers for the Helix (ASPLOS'25) artifact data: cluster files, solutions, profiles, T tables.

Everything here is pure parsing plus the authors' node-throughput formula, re-implemented from
the description in ``shared/data/helix/README.md``. No solver, no network.

Unit conventions (kept exactly as the authors use them, so that their numbers reproduce):

* bandwidth strings such as ``1000 * mbps`` evaluate to 1e9 (mbps = 1e6, gbps = 1e9, kbps = 1e3);
  the authors divide that number *directly by a size in bytes*. :class:`HelixLink.bandwidth` holds
  the evaluated number untouched; converting it to a capacity is the topology's job, where the
  convention is an explicit parameter (see ``topology.BandwidthConvention``).
* latency strings such as ``1 * MilliSec`` evaluate to seconds (1e-3).
* profile csv rows are ``batch_tokens, milliseconds per ONE layer``.
"""

from __future__ import annotations

import ast
import bisect
import configparser
import json
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from p2pserve.errors import ConfigError, UnknownModelError

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


def helix_data_dir() -> Path:
    """Directory holding the Helix artifact data.

    ``$P2PSERVE_HELIX_DATA`` if set, else ``<repo root>/../shared/data/helix`` where the repo
    root is the parent of the ``p2pserve`` package directory. Raises :class:`ConfigError` when
    neither exists.
    """
    env = os.environ.get("P2PSERVE_HELIX_DATA")
    if env:
        path = Path(env)
        if not path.is_dir():
            raise ConfigError(f"P2PSERVE_HELIX_DATA={env!r} is not a directory")
        return path
    repo_root = Path(__file__).resolve().parent.parent.parent
    path = (repo_root / ".." / "shared" / "data" / "helix").resolve()
    if path.is_dir():
        return path
    raise ConfigError(
        f"Helix data not found at {path}; set P2PSERVE_HELIX_DATA to the directory holding "
        "clusters/, profiles/ and node_throughput/"
    )


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


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear interpolation; beyond the last row extrapolate with the last slope."""
    if x <= xs[0]:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    if i >= len(xs):
        # Extrapolate linearly from the last segment: batches bigger than profiled cost more.
        x0, x1, y0, y1 = xs[-2], xs[-1], ys[-2], ys[-1]
        slope = (y1 - y0) / (x1 - x0) if x1 != x0 else 0.0
        return y1 + max(slope, 0.0) * (x - x1)
    if xs[i] == x:
        return ys[i]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class LatencyProfile:
    """Per-layer latency of one GPU type for one model (milliseconds per ONE layer)."""

    prompt_tokens: tuple[float, ...]
    prompt_ms_values: tuple[float, ...]
    decode_tokens: tuple[float, ...]
    decode_ms_values: tuple[float, ...]

    def prompt_ms(self, tokens: float) -> float:
        """Milliseconds for one layer to prefill a batch of ``tokens`` prompt tokens."""
        return _interp(list(self.prompt_tokens), list(self.prompt_ms_values), tokens)

    def decode_ms(self, tokens: float) -> float:
        """Milliseconds for one layer to decode a batch of ``tokens`` decode tokens."""
        return _interp(list(self.decode_tokens), list(self.decode_ms_values), tokens)


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


def load_profile(model: str, gpu_type: str) -> LatencyProfile:
    """Latency profile of ``gpu_type`` (``A100``/``a100``, ``L4``, ``T4x2``...) for ``model``."""
    return _load_profile_cached(_model_dir(model), gpu_type.lower(), str(helix_data_dir()))


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


def _canon_type(name: str, table: dict) -> str:
    for key in table:
        if key.lower() == name.lower():
            return key
    raise ConfigError(f"GPU type {name!r} not in {sorted(table)}")


def load_machine_params(model: str) -> MachineParams:
    """Read ``profiles/machine_params.json`` for ``model`` (``llama2-70b`` / ``llama1-30b``)."""
    mdir = _model_dir(model)
    raw = json.loads((helix_data_dir() / "profiles" / "machine_params.json").read_text())
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


def load_machine_profiles(path: str | os.PathLike | None = None) -> dict[str, dict[str, float]]:
    """``machine_profiles.ini``: type -> {inbound_nic_speed, outbound_nic_speed, vram_size} (evaluated)."""
    path = Path(path) if path else helix_data_dir() / "clusters" / "single_cluster" / "machine_profiles.ini"
    cp = _read_ini(path)
    return {sec: {k: parse_quantity(v) for k, v in cp.items(sec)} for sec in cp.sections()}


def _mixed_batch_throughput(
    prof: LatencyProfile, mp: MachineParams, gpu: str, k: int, ratio: float
) -> float:
    """Tokens/s of the authors' "typical" mixed prompt+decode batch for a node holding k layers."""
    I, O = mp.avg_input_len, mp.avg_output_len
    kv = mp.kv_capacity(gpu, k)
    avail = int(mp.kv_cache_hwm * kv / k)
    pr = avail / (I + O) * ratio / O
    if pr > 1:
        pr, pt, dt = 1.0, I, O
    else:
        pt = round(pr * I)
        dt = round(avail / (I + O) * ratio)
    if pr >= 1:
        ms = k * (prof.prompt_ms(pt) + prof.decode_ms(dt))
        return (pt + dt) / ms * 1000.0
    rho = 1.0 / pr
    ms = k * (prof.prompt_ms(int(pt * rho)) + rho * prof.decode_ms(dt))
    return rho * (pt + dt) / ms * 1000.0


def throughput_table(
    model: str, node_types: list[str], nic_bytes_per_s: float | None = None
) -> dict[str, list[float]]:
    """T[k] per GPU type present in a cluster with these ``node_types`` (authors' formula).

    Returns type -> list where index k (1..max_num_layers) is tokens/s holding k layers and
    index 0 is 0. The result depends on the cluster composition through the average per-layer
    time ``t̄`` (see README), so pass the full list of node types.
    """
    mp = load_machine_params(model)
    L = mp.num_layers
    counts: dict[str, int] = {}
    for t in node_types:
        key = _canon_type(t, mp.gpus)
        counts[key] = counts.get(key, 0) + 1
    # The authors switch to the larger "typical #layers" table when the cluster, loaded with the
    # default typical counts, would hold fewer than 1.2 model copies (verified against their
    # cluster10 and cluster24 tables; single-type clusters do not depend on the choice).
    typical_capacity = sum(mp.typical_layers_default[t] * n for t, n in counts.items())
    typical = mp.typical_layers_small if typical_capacity < 1.2 * L else mp.typical_layers_default
    perf = {t: mp.initial_normalized_perf[t] for t in counts}
    profs = {t: load_profile(model, t) for t in counts}

    def tables(perf_now: dict[str, float]) -> dict[str, list[float]]:
        num = sum(counts[t] * typical[t] * (1.0 / perf_now[t]) for t in counts)
        den = sum(counts[t] * typical[t] for t in counts)
        tbar = num / den
        out = {}
        for t in counts:
            tm = 1.0 / perf_now[t]
            row = [0.0]
            for k in range(1, mp.gpus[t].max_num_layers + 1):
                r = k * tm / ((L - k) * tbar + k * tm)
                row.append(_mixed_batch_throughput(profs[t], mp, t, k, r))
            out[t] = row
        return out

    for _ in range(10):
        cur = tables(perf)
        perf = {t: cur[t][min(typical[t], len(cur[t]) - 1)] * typical[t] for t in counts}
    final = tables(perf)
    if nic_bytes_per_s is None:
        nic_bytes_per_s = 10e9  # every GPU type in machine_profiles.ini has a 10 Gbps NIC
    cap = nic_bytes_per_s / mp.activation_size_bytes
    return {t: [min(v, cap) if i else 0.0 for i, v in enumerate(row)] for t, row in final.items()}


def node_throughput_tables(cluster: HelixCluster, model: str) -> list[list[float]]:
    """T[i][k]: tokens/s of compute node i holding k layers (index 0 is 0), authors' formula."""
    by_type = throughput_table(model, cluster.node_types)
    mp = load_machine_params(model)
    return [list(by_type[_canon_type(t, mp.gpus)]) for t in cluster.node_types]


def load_reference_throughput(name: str) -> list[list[float]]:
    """The authors' own T tables from ``node_throughput/<name>.json`` (same shape as above)."""
    raw = json.loads((helix_data_dir() / "node_throughput" / f"{name}.json").read_text())
    table = raw["node_T_tokens_per_s"]
    out = []
    for i in range(len(table)):
        row = table[str(i)]
        kmax = max(int(k) for k in row)
        out.append([0.0] + [float(row[str(k)]) for k in range(1, kmax + 1)])
    return out


def vram_bytes(gpu_type: str) -> float:
    """VRAM of a GPU type from ``machine_profiles.ini`` (e.g. T4 16 GB -> 16e9)."""
    profiles = load_machine_profiles()
    for name, vals in profiles.items():
        if name.lower() == gpu_type.lower():
            return vals["vram_size"]
    raise ConfigError(f"GPU type {gpu_type!r} has no VRAM entry in machine_profiles.ini")
