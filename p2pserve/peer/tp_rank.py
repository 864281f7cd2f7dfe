"""Rank 1..N-1 of a tensor-parallel peer: ``python -m p2pserve.peer.tp_rank`` (started by tp_group.py).

It holds its slice of every shard rank 0 loaded and the KV cache of its heads for every session,
and runs whatever step rank 0 sends. Caches follow rank 0's without messages of their own: each
segment is run after truncating its cache to the segment's position (so rewinds and failed steps
carry over), and a session's cache is freed when rank 0 says its cache was collected. The process
exits when rank 0 says STOP (0), when its parent is gone, or on any error (non-zero): rank 0 then
sees the group fail.
"""

from __future__ import annotations

import argparse
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NoReturn

import torch

from p2pserve.model.shard import TORCH_DTYPES, Segment
from p2pserve.model.spec import load_spec
from p2pserve.model.tensor_parallel import TPShard, local_spec
from p2pserve.model.tp_comm import LOAD, PING, STEP, STOP, Message, TPComm, exit_without_teardown
from p2pserve.parent_watch import watch_parent
from p2pserve.peer.kv_cache import SequenceCache

log = logging.getLogger(__name__)


class RankServer:
    """The loop of one non-zero rank."""

    def __init__(self, comm: TPComm, model_path: str, dtype: str, device: str):
        self.comm, self.model_path, self.device = comm, model_path, device
        self.spec = load_spec(model_path, dtype=dtype)
        self.kv_spec = local_spec(self.spec, comm.world)
        self.shards: dict[int, Future] = {}
        self.caches: dict[int, SequenceCache] = {}
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="p2pserve-tp-load")

    def serve(self) -> int:
        """Run messages until STOP; returns the exit status."""
        while True:
            msg = self.comm.receive()
            for key in msg.dropped_caches:
                self.caches.pop(key, None)
            for shard_id in msg.dropped_shards:
                self.shards.pop(shard_id, None)
            if msg.kind == STOP:
                return 0
            if msg.kind == LOAD:
                self.shards[msg.shard_id] = self._loader.submit(
                    TPShard.load_split, self.model_path, self.spec, msg.start, msg.end, self.device, self.comm,
                    msg.shard_id)
            elif msg.kind == STEP:
                self.step(msg)
            elif msg.kind != PING:
                raise ValueError(f"unknown message kind {msg.kind}")

    @torch.inference_mode()
    def step(self, msg: Message) -> None:
        """Run one step rank 0 sent, on this rank's slice."""
        shard: TPShard = self.shards[msg.shard_id].result()  # waits for a load still running
        segments, at = [], 0
        for s in msg.segments:
            cache = self.caches.get(s.key)
            if cache is None:
                cache = self.caches[s.key] = SequenceCache(
                    s.start, s.end, self.kv_spec.num_kv_heads, self.spec.head_dim, s.max_length,
                    TORCH_DTYPES[self.spec.dtype], self.device)
            cache.truncate(s.position)
            if cache.length != s.position:
                raise RuntimeError(f"cache {s.key} holds {cache.length} positions, step starts at {s.position}")
            hidden = msg.hidden[at:at + s.n]
            at += s.n
            segments.append(Segment(hidden, s.position, s.start, s.end, cache, hidden=hidden, rope_end=s.rope_end))
        shard.compute(segments)


def main(argv: list[str] | None = None) -> NoReturn:
    """Entry point of a child rank; ends the process with its exit status."""
    p = argparse.ArgumentParser(prog="python -m p2pserve.peer.tp_rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--rendezvous", required=True, help="the group's FileStore path (rank 0's private directory)")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level="WARNING", format=f"%(asctime)s %(levelname)s tp-rank{args.rank}: %(message)s")
    watch_parent(os.getppid(), lambda: os._exit(3))  # exit as soon as the peer that started this rank is gone
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    spec = load_spec(args.model, dtype=args.dtype)
    comm = TPComm.connect(args.rank, args.world, args.rendezvous, args.device, spec.hidden_size, args.dtype, args.timeout)
    try:
        status = RankServer(comm, args.model, args.dtype, args.device).serve()
    except Exception:
        log.exception("rank %d failed", args.rank)
        status = 1
    exit_without_teardown(status)  # on an error another rank may be gone: no collective teardown


if __name__ == "__main__":
    main()
