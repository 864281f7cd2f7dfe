"""A tensor-parallel group as one logical peer: rank 0 is the peer process, ranks 1..N-1 its children.

Rank 0 runs everything a peer runs (DHT, handlers, worker, batcher); its shard is a
:class:`~p2pserve.model.tensor_parallel.TPShard` whose ``forward_batch`` sends each step to the
children (``python -m p2pserve.peer.tp_rank``) and runs its own slice with them. The group is
announced as one PeerInfo; the profiler times the group's forward (``load`` is its shard loader).

Lifecycle: a child that exits, or a collective that fails or times out, fails the group:
``on_failure`` fires once (``p2pserve peer`` then withdraws and exits non-zero) and every later
step is refused with a retriable error, so clients fail over as from any dead peer. Children
watch their parent and exit when it is gone; idle rank 0 pings them so their timeout only fires
on a silent group.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Callable

from p2pserve.config import TPConfig
from p2pserve.errors import ConfigError, P2PServeError
from p2pserve.model.spec import ModelSpec
from p2pserve.model.tensor_parallel import TPShard, check_splittable
from p2pserve.model.tp_comm import LOAD, STOP, TPComm

log = logging.getLogger(__name__)


class GroupFailedError(P2PServeError):
    """A member of this peer's tensor-parallel group died or stopped answering."""


def _rendezvous_file() -> str:
    """A fresh path in a private directory (mode 0700) for the group's ``FileStore``."""
    return os.path.join(tempfile.mkdtemp(prefix="p2pserve-tp-"), "rendezvous")


class TPGroup:
    """Rank 0's handle on the group: its children, its ``TPComm``, and the shard loader."""

    def __init__(self, config: TPConfig, comm: TPComm, children: list[subprocess.Popen]):
        self.config, self.comm, self.children = config, comm, children
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._watch_loop, name="p2pserve-tp-watch", daemon=True)
        self._watch.start()

    @classmethod
    def start(cls, config: TPConfig, model_path: str, spec: ModelSpec,
              on_failure: Callable[[str], None] | None = None) -> "TPGroup":
        """Spawn ranks 1..N-1 and join them in a process group (blocking: call it in a thread);
        ``on_failure`` is told once if the group fails."""
        check_splittable(spec, config.world)
        if config.world < 2:
            raise ConfigError("a tensor-parallel group needs at least two devices")
        rendezvous = _rendezvous_file()
        children = []
        for rank in range(1, config.world):
            cmd = [sys.executable, "-m", "p2pserve.peer.tp_rank", "--rank", str(rank), "--world", str(config.world),
                   "--rendezvous", rendezvous, "--model", model_path, "--dtype", spec.dtype,
                   "--device", config.devices[rank], "--timeout", str(config.timeout_s)]
            if config.num_threads:
                cmd += ["--num-threads", str(config.num_threads)]
            children.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
        try:
            comm = TPComm.connect(0, config.world, rendezvous, config.devices[0], spec.hidden_size, spec.dtype,
                                  config.timeout_s, on_failure)
        except Exception:
            for c in children:
                c.kill()
            shutil.rmtree(os.path.dirname(rendezvous), ignore_errors=True)
            raise
        # the ranks may still read the store while they finish joining: the file goes at exit
        atexit.register(shutil.rmtree, os.path.dirname(rendezvous), True)
        log.info("tensor-parallel group of %d on %s (children %s)", config.world, ",".join(config.devices),
                 [c.pid for c in children])
        return cls(config, comm, children)

    @property
    def child_pids(self) -> list[int]:
        return [c.pid for c in self.children]

    def load(self, model_path: str, spec: ModelSpec, start: int, end: int, device: str | None = None) -> TPShard:
        """Load layers [start, end) on every rank (``Shard.load``'s signature; ``device`` is rank 0's)."""
        if self.comm.failed:
            raise GroupFailedError(f"tensor-parallel group failed: {self.comm.failed}")
        shard_id = next(self._ids)
        with self.comm.lock:
            self.comm.send(LOAD, shard_id, start, end)  # the children load while rank 0 does
        shard = TPShard.load_split(model_path, spec, start, end, device or self.config.devices[0], self.comm, shard_id)
        weakref.finalize(shard, self.comm.dropped_shards.append, shard_id)
        return shard

    def _watch_loop(self) -> None:
        while not self._stop.wait(0.2):
            dead = [(c.pid, c.returncode) for c in self.children if c.poll() is not None]
            if dead:
                self.comm.fail(f"rank process(es) exited: {dead}")
                return
            self.comm.ping_if_idle(self.config.ping_s)

    def stop(self, grace_s: float = 10.0) -> None:
        """Tell the children to exit, wait for them (then kill what is left), leave the group."""
        self._stop.set()
        if self.comm.failed is None and self.comm.lock.acquire(timeout=grace_s):
            try:
                self.comm.send(STOP)
            except Exception:
                pass
            finally:
                self.comm.lock.release()
        deadline = time.monotonic() + grace_s
        for c in self.children:
            try:
                c.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait()
        if self.comm.failed is None:
            self.comm.close()


def parse_gpus(text: str) -> tuple[int, ...]:
    """``--gpu`` as CUDA indices: "1" -> (1,), "0,1,2,3" -> (0, 1, 2, 3)."""
    try:
        gpus = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--gpu takes an index or a comma list of indices, got {text!r}") from None
    if len(set(gpus)) != len(gpus) or any(g < 0 for g in gpus):
        raise ConfigError(f"--gpu lists each device once: {text!r}")
    return gpus


def tp_devices(device: str, gpus: tuple[int, ...] | None, tp: int | None) -> tuple[str, ...] | None:
    """The ranks' devices for ``--device``/``--gpu``/``--tp``, or None without tensor parallelism."""
    if gpus is not None and len(gpus) > 1:
        if tp is not None and tp != len(gpus):
            raise ConfigError(f"--tp {tp} disagrees with the {len(gpus)} devices of --gpu")
        return tuple(f"cuda:{g}" for g in gpus)
    if tp is None or tp == 1:
        return None
    if tp < 1:
        raise ConfigError(f"--tp must be >= 1, got {tp}")
    if device != "cpu":
        raise ConfigError("--tp N runs N processes on CPU (--device cpu); on CUDA list the devices: --gpu 0,1")
    return ("cpu",) * tp

