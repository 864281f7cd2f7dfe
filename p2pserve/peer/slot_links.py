"""Measure the links between a machine's slots (GPUs, or CPU slots) as ``MachineInfo`` links.

A machine agent (``p2pserve machine``) runs ``python -m p2pserve.peer.slot_links`` once per slot,
joined in one ``torch.distributed`` group (gloo on CPU, NCCL on CUDA) on a loopback store. For
every slot pair, in turn, the two slots time a two-rank all-reduce of a small and a large tensor
(the others wait at a barrier); the figures are summed onto rank 0, which prints them as one
JSON line. A two-rank ring all-reduce of ``m`` bytes takes ``alpha + m / beta``
(``placement/tp_cost.py`` with d = 2), so the two sizes give the link's bus bandwidth ``beta``
and per-collective latency ``alpha`` (:func:`fit_pair`, pure). What rank 0 prints is parsed
back by :func:`measure_links` and validated as ``GpuLink`` records like any record read from the
network would be (``MachineInfo.validate``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
import subprocess
import sys
import time

from p2pserve.dht.machine_info import GpuLink
from p2pserve.errors import ConfigError

SMALL_BYTES = 8 * 4  # 8 fp32 values: the collective's fixed cost
LARGE_BYTES = 4 << 20  # 4 MiB: long enough that the fixed cost is a small part
REPEATS = 7
MARK = "P2PSERVE_SLOT_LINKS "


def fit_pair(small_bytes: float, small_s: float, large_bytes: float, large_s: float) -> tuple[float, float]:
    """(bus bandwidth in bytes/s, latency in s) of ``t(m) = alpha + m / beta`` through two points.

    A large transfer timed no slower than the small one (timer noise) reads as the record's
    ceiling bandwidth, 1 TB/s, rather than a negative or infinite figure."""
    alpha = max(0.0, small_s)
    extra = large_s - small_s
    beta = (large_bytes - small_bytes) / extra if extra > 0 else 1e12
    return min(beta, 1e12), alpha


def pairs(n: int) -> list[tuple[int, int]]:
    """Every slot pair ``(a, b)``, ``a < b``, in the order all ranks create their subgroups."""
    return list(itertools.combinations(range(n), 2))


def _time_allreduce(dist, group, numel: int, device: str) -> float:
    import torch

    x = torch.ones(numel, dtype=torch.float32, device=device)
    dist.all_reduce(x, group=group)  # warm-up: connection set-up is not the link
    times = []
    for _ in range(REPEATS):
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        dist.all_reduce(x, group=group)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]  # the median: one descheduled repeat is not the link


def _run_rank(rank: int, world: int, port: int, device: str, timeout_s: float) -> None:
    """One slot's part: every pair's subgroup, the timings of the pairs it leads, summed to rank 0."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    backend = "nccl" if device.startswith("cuda") else "gloo"
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    every = pairs(world)
    groups = [dist.new_group(list(p)) for p in every]  # every rank creates every subgroup, same order
    # [pairs, 2]: (small time, large time) filled by the pair's first slot
    found = torch.zeros(len(every), 2, dtype=torch.float64)
    for i, (a, b) in enumerate(every):
        if rank in (a, b):
            small = _time_allreduce(dist, groups[i], SMALL_BYTES // 4, device)
            large = _time_allreduce(dist, groups[i], LARGE_BYTES // 4, device)
            if rank == a:
                found[i] = torch.tensor([small, large], dtype=torch.float64)
        dist.barrier()
    dist.all_reduce(found)  # gloo sums on CPU; one copy per pair was non-zero
    if rank == 0:
        print(MARK + json.dumps([[a, b, float(s), float(l)] for (a, b), (s, l) in zip(every, found.tolist())]),
              flush=True)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_result(text: str, n: int, kind: str) -> list[GpuLink]:
    """Rank 0's JSON line as validated links among ``n`` slots (``ConfigError`` if absent or malformed)."""
    from p2pserve.dht.machine_info import GpuOffer, MachineInfo
    from p2pserve.errors import RecordRejected

    line = next((l[len(MARK):] for l in text.splitlines() if l.startswith(MARK)), None)
    if line is None:
        raise ConfigError("the slot link measurement printed no result")
    try:
        rows = json.loads(line)
        if not isinstance(rows, list) or [tuple(r[:2]) for r in rows] != pairs(n):
            raise ValueError("not one row per slot pair")
        if not all(isinstance(t, float) and 0.0 <= t < 60.0 for r in rows for t in r[2:]) or any(len(r) != 4 for r in rows):
            raise ValueError("times are not seconds")
        links = [GpuLink(a=a, b=b, bandwidth=fit_pair(SMALL_BYTES, s, LARGE_BYTES, l)[0],
                         latency_s=fit_pair(SMALL_BYTES, s, LARGE_BYTES, l)[1], kind=kind) for a, b, s, l in rows]
        MachineInfo(model="m", machine_id="m", gpus=[GpuOffer(device="x", memory_bytes=1)] * n, links=links).validate()
    except (ValueError, TypeError, RecordRejected) as e:
        raise ConfigError(f"malformed slot link measurement: {e}") from e
    return links


def measure_links(devices: list[str], timeout_s: float = 60.0) -> list[GpuLink]:
    """Measure every pair of ``devices`` (one process each; blocking, call it in a thread)."""
    n = len(devices)
    if n < 2:
        return []
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "p2pserve.peer.slot_links", "--rank", str(r), "--world", str(n),
                               "--port", str(port), "--device", devices[r], "--timeout", str(timeout_s)],
                              stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                              text=True) for r in range(n)]
    try:
        out, _ = procs[0].communicate(timeout=timeout_s * 2)
        for p in procs[1:]:
            p.wait(timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode != 0 for p in procs):
        raise ConfigError(f"slot link measurement failed: exit codes {[p.returncode for p in procs]}")
    kind = "other" if devices[0] == "cpu" else "pcie"  # NVLink is not told apart yet: see docs/hexgen.md
    return parse_result(out, n, kind)


def main(argv=None) -> int:
    """Entry point of one measuring rank."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--timeout", type=float, default=60.0)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    _run_rank(a.rank, a.world, a.port, a.device, a.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
