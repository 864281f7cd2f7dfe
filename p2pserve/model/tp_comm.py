"""The messages of a tensor-parallel group: rank 0 tells the other ranks what to run, in tensors.

Every message is an int64 header broadcast from rank 0, ``[kind, shard_id, start, end, n_segments,
n_dropped_caches, n_dropped_shards]``, followed for a step by an int64 body (per segment
``SEG_FIELDS`` ints, then the dropped cache keys and shard ids) and the step's hidden states
[sum n, H] in the model's dtype. No pickle: only fixed-layout integer tensors and one float tensor,
bounded before anything is allocated. Rank 0 sends; ``receive`` is what the other ranks run.

The group talks over loopback TCP (gloo on CPU, NCCL on CUDA) with a collective timeout, so a rank
that stops answering fails the others instead of hanging them.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, NoReturn

import torch
import torch.distributed as dist

from p2pserve.errors import RequestError
from p2pserve.model.shard import TORCH_DTYPES

log = logging.getLogger(__name__)

STEP, LOAD, PING, STOP = 1, 2, 3, 4
HEADER_FIELDS = 7
SEG_FIELDS = 7  # cache key, position, n, start, end, rope_end (-1: None), max_length
MAX_SEGMENTS = 1 << 14
MAX_DROPS = 1 << 16
MAX_ROWS = 1 << 20  # tokens in one step


@dataclass
class SegmentLayout:
    """One segment of a step as the other ranks receive it."""

    key: int
    position: int
    n: int
    start: int
    end: int
    rope_end: int | None
    max_length: int


@dataclass
class Message:
    """What ``TPComm.receive`` returns."""

    kind: int
    shard_id: int = 0
    start: int = 0
    end: int = 0
    segments: list[SegmentLayout] = field(default_factory=list)
    hidden: torch.Tensor | None = None
    dropped_caches: list[int] = field(default_factory=list)
    dropped_shards: list[int] = field(default_factory=list)


class TPComm:
    """One rank's end of the group's process group (``torch.distributed``'s default group)."""

    def __init__(self, rank: int, world: int, device: str, hidden_size: int, dtype: str,
                 on_failure: Callable[[str], None] | None = None):
        self.rank, self.world = rank, world
        self.device = torch.device(device)
        self.hidden_size, self.dtype = hidden_size, TORCH_DTYPES[dtype]
        self.lock = threading.Lock()  # rank 0: one message (and the step it starts) at a time
        self.failed: str | None = None  # rank 0: why the group failed, once it did
        self.on_failure = on_failure  # rank 0: told why, once, from whichever thread saw the failure
        self.dropped_caches: list[int] = []  # rank 0: keys to free with the next message
        self.dropped_shards: list[int] = []
        self.last_sent = time.monotonic()

    @classmethod
    def connect(cls, rank: int, world: int, rendezvous: str, device: str, hidden_size: int, dtype: str,
                timeout_s: float, on_failure: Callable[[str], None] | None = None) -> "TPComm":
        """Join the group through the file ``rendezvous`` (in a directory only this user can
        open); blocks until all ranks are in. ``on_failure`` is told once if the group fails.

        The group meets through a file, not a TCP store: torch's ``TCPStore`` listens on every
        interface whatever host it is given and takes writes from anyone who connects, and all
        ranks of a group run on one machine anyway. The collectives' own sockets stay on loopback
        (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, unless the operator set them)."""
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(torch.device(device))
        loopback = next((name for _, name in socket.if_nameindex() if name in ("lo", "lo0")), None)
        if loopback is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)
        dist.init_process_group(backend, store=dist.FileStore(rendezvous, world), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return cls(rank, world, device, hidden_size, dtype, on_failure)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns it."""
        dist.all_reduce(t)
        return t

    def fail(self, reason: str) -> None:
        """Mark the group failed (once) and tell ``on_failure``."""
        if self.failed is not None:
            return
        self.failed = reason
        log.error("tensor-parallel group failed: %s", reason)
        if self.on_failure is not None:
            self.on_failure(reason)

    # ------------------------------------------------------------------ rank 0 (hold ``lock``)
    def send_step(self, shard_id: int, layout: list[tuple[int, ...]], hidden: torch.Tensor) -> None:
        """Send one step: its segments' layout and hidden states [sum n, H]."""
        self._send(STEP, shard_id, 0, 0, layout, hidden)

    def send(self, kind: int, shard_id: int = 0, start: int = 0, end: int = 0) -> None:
        """Send a message without a step (LOAD, PING, STOP)."""
        self._send(kind, shard_id, start, end, [], None)

    def _send(self, kind, shard_id, start, end, layout, hidden) -> None:
        # pop, not copy-and-clear: finalizers append from any thread
        caches = [self.dropped_caches.pop() for _ in range(len(self.dropped_caches))]
        shards = [self.dropped_shards.pop() for _ in range(len(self.dropped_shards))]
        header = [kind, shard_id, start, end, len(layout), len(caches), len(shards)]
        dist.broadcast(torch.tensor(header, dtype=torch.int64, device=self.device), 0)
        body = [v for row in layout for v in row] + caches + shards
        if body:
            dist.broadcast(torch.tensor(body, dtype=torch.int64, device=self.device), 0)
        if hidden is not None:
            dist.broadcast(hidden.contiguous(), 0)
        self.last_sent = time.monotonic()

    def ping_if_idle(self, after_s: float) -> None:
        """Send a PING if nothing was sent for ``after_s`` and no step runs: the other ranks'
        collective timeout must not fire while the peer is merely idle."""
        if time.monotonic() - self.last_sent < after_s or not self.lock.acquire(blocking=False):
            return
        try:
            if self.failed is None:
                self.send(PING)
        except Exception as e:
            self.fail(f"ping failed: {type(e).__name__}: {e}")
        finally:
            self.lock.release()

    # ------------------------------------------------------------------ ranks 1..N-1
    def receive(self) -> Message:
        """Wait for rank 0's next message."""
        header = torch.empty(HEADER_FIELDS, dtype=torch.int64, device=self.device)
        dist.broadcast(header, 0)
        kind, shard_id, start, end, n_seg, n_caches, n_shards = header.tolist()
        if not (0 <= n_seg <= MAX_SEGMENTS and 0 <= n_caches <= MAX_DROPS and 0 <= n_shards <= MAX_DROPS):
            raise RequestError(f"malformed tensor-parallel header {header.tolist()}")
        msg = Message(kind, shard_id, start, end)
        size = n_seg * SEG_FIELDS + n_caches + n_shards
        if size:
            body = torch.empty(size, dtype=torch.int64, device=self.device)
            dist.broadcast(body, 0)
            values = body.tolist()
            for i in range(n_seg):
                key, pos, n, s, e, rope_end, max_length = values[i * SEG_FIELDS:(i + 1) * SEG_FIELDS]
                msg.segments.append(SegmentLayout(key, pos, n, s, e, None if rope_end < 0 else rope_end, max_length))
            at = n_seg * SEG_FIELDS
            msg.dropped_caches = values[at:at + n_caches]
            msg.dropped_shards = values[at + n_caches:]
        if kind == STEP:
            rows = sum(s.n for s in msg.segments)
            if not (0 < rows <= MAX_ROWS) or any(s.n <= 0 for s in msg.segments):
                raise RequestError(f"malformed tensor-parallel step of {rows} rows")
            msg.hidden = torch.empty(rows, self.hidden_size, dtype=self.dtype, device=self.device)
            dist.broadcast(msg.hidden, 0)
        return msg

    def close(self) -> None:
        """Leave the process group."""
        try:
            dist.destroy_process_group()
        except Exception:  # already torn down, or a rank is gone
            pass


def exit_without_teardown(status: int) -> NoReturn:
    """End a process that joined a process group: flush logs and stdio, then ``os._exit``.

    The interpreter's teardown is skipped on purpose. After a clean STOP and ``close``, it once
    aborted a rank in CI that had done all its work (std::terminate, "terminate called without an
    active exception", exit -6); gloo's worker threads may outlive the interpreter's finalization
    (pytorch/pytorch#179291 describes such an abort). The other ranks see this one go as if it died.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed pipe: nothing more to say
            pass
    os._exit(status)
