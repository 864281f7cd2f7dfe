"""Tensor-parallel peers (``--tp N`` on CPU, gloo) in real processes: in a route with peers of
other TP sizes greedy output equals single-process `generate` in fp32, and a killed member takes
its group down cleanly while the client fails over with identical output.

Summation order: a TP-N peer adds N partial o_proj / down_proj sums where `generate` runs one
matmul; the tiny models' weights (std 0.1) keep argmax gaps far above that rounding, and no token
flipped in these tests.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from p2pserve.client.generation import Generation
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.client.params import GenerationParams
from p2pserve.model.tiny import build_tiny_model
from p2pserve.launch import Child, PeerProcess
from tests.harness import client_node, reference_generate, run_chain, start_peers
from tests.support import wait_for
from tests.support.swarm import CONFIG, pipeline_over

pytestmark = pytest.mark.integration

GREEDY = GenerationParams(max_new_tokens=16, ignore_eos=True)


def rank_children(pid: int) -> list[int]:
    """Pids of the tensor-parallel ranks a peer process started (not its DHT / daemon children)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"p2pserve.peer.tp_rank" in cmdline:
                found.append(int(child))
    return found


def prompt(path, text):
    return LocalModelInfo.load(path).chat_ids([{"role": "user", "content": text}])


def test_tp2_and_tp1_peers_in_one_route_match_generate(model_dir):
    path = model_dir("llama")  # 4 heads, 2 KV heads: TP 1 or 2
    tp2, = start_peers(path, [(0, 4)], "--tp", "2")
    tp1, = start_peers(path, [(4, 8)])
    try:
        assert len(rank_children(tp2.proc.pid)) == 1
        model = LocalModelInfo.load(path)
        ids = prompt(path, "Split the heads of every layer across two processes.")
        ref = reference_generate(path, ids, GREEDY.max_new_tokens)
        assert asyncio.run(run_chain(model, [tp2.hop(), tp1.hop()], ids, GREEDY)) == ref
        assert asyncio.run(run_chain(model, [tp2.hop(0, 2), tp2.hop(2, 4), tp1.hop()], ids, GREEDY)) == ref  # two hops, one group
    finally:
        for p in (tp2, tp1):
            p.stop()
    assert tp2.proc.returncode == 0, tp2.output()  # a clean stop stops the ranks with it


def test_tp4_tp2_tp1_route_matches_generate(tmp_path):
    # 4 KV heads so that TP 4 splits them; one route crosses groups of 4, 2 and 1
    path = str(build_tiny_model("llama", tmp_path / "llama-kv4", seed=0, num_key_value_heads=4))
    tp4, tp2, tp1 = peers = [PeerProcess.launch(path, r, *x) for r, x in
                             (((0, 3), ("--tp", "4")), ((3, 6), ("--tp", "2")), ((6, 8), ()))]
    try:
        for p in peers:
            p.wait_ready(240)
        model = LocalModelInfo.load(path)
        ids = prompt(path, "One route, three kinds of peer.")
        ref = reference_generate(path, ids, GREEDY.max_new_tokens)
        assert asyncio.run(run_chain(model, [tp4.hop(), tp2.hop(), tp1.hop()], ids, GREEDY)) == ref
    finally:
        for p in (tp4, tp2, tp1):
            p.stop()


def test_killed_member_takes_the_group_down_and_the_client_fails_over(model_dir):
    path = model_dir("llama")
    tp2, = start_peers(path, [(0, 4)], "--tp", "2")
    others = start_peers(path, [(0, 4), (4, 8)])  # a TP-1 replica of [0:4), and the second half
    peers = [tp2, *others]
    try:
        ids = prompt(path, "A member of the group dies; the answer stays the same.")
        ref = reference_generate(path, ids, GREEDY.max_new_tokens)
        (child,) = rank_children(tp2.proc.pid)
        tokens, pipeline = asyncio.run(_generate_killing(path, peers, ids, tp2.peer_id, child))
        assert tokens == ref
        assert [f.hop.peer_id for f in pipeline.failures] == [tp2.peer_id]
        # the group withdrew: rank 0 exits non-zero on its own, saying why
        wait_for(lambda: not tp2.alive, "the TP peer exits after its member died", timeout=60)
        assert tp2.proc.returncode not in (0, None)
        assert "tensor-parallel group failed" in tp2.output(), tp2.output()
    finally:
        for p in peers:
            p.stop()


async def _generate_killing(path, peers, ids, tp_peer_id: str, child: int, after: int = 5):
    """Greedy generation whose route starts at the TP peer; SIGKILL its child rank after ``after`` tokens."""
    model = LocalModelInfo.load(path)
    for seed in range(20):  # a route provider that starts on the TP peer
        async with client_node(CONFIG) as transport:
            pipeline = pipeline_over(transport, model, peers, GREEDY, seed=seed)
            gen = Generation(pipeline, ids, GREEDY, model.eos_ids)
            try:
                n = 0
                async for _ in gen:
                    n += 1
                    if n == 1 and pipeline.route[0].peer_id != tp_peer_id:
                        break
                    if n == after:
                        os.kill(child, signal.SIGKILL)
                else:
                    return gen.result.tokens, pipeline
            finally:
                await pipeline.close()
    raise AssertionError("no route started at the TP peer")


TIMING = dict(peer_refresh=0.5, candidate_refresh=0.5, plan_refresh=2.0, link_refresh=2.0, max_clock_skew=2.0)


def test_group_announces_one_record_and_withdraws_when_a_member_dies(model_dir, tmp_path):
    from p2pserve.cli.common import write_local_swarm_file
    from p2pserve.config import DHTConfig
    from p2pserve.dht.swarm import Swarm
    from p2pserve.model.default import cache_dir

    path = model_dir("llama")
    spec = LocalModelInfo.load(path).spec
    boot_file = tmp_path / "boot.maddrs"
    boot_proc = Child.spawn("boot", ["bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                     "--maddrs-file", str(boot_file)])
    peer = observer = None
    try:
        wait_for(boot_file.exists, "bootstrap")
        boot = boot_file.read_text().split()
        cfg = tmp_path / "swarm.json"
        write_local_swarm_file(cfg, spec, boot, "tp-swarm", "/ip4/127.0.0.1/tcp/0", TIMING, 0.5)
        peer = PeerProcess.launch(path, (0, 4), "--config", str(cfg), "--tp", "2", "--max-layers", "4",
                                  "--profile-batch", "4").wait_ready(240)
        observer = Swarm.create(DHTConfig(model=spec.model_id, swarm_id="tp-swarm", initial_peers=tuple(boot),
                                          host_maddrs=("/ip4/127.0.0.1/tcp/0",), client_mode=True, **TIMING))

        def records():
            return {pid: s.record for pid, s in asyncio.run(observer.get_peers()).items()}

        info = wait_for(lambda: records().get(peer.peer_id), "the group's record", timeout=60)
        assert tuple(info.serving) == (0, 4) and info.state == "serving"
        assert info.device == "cpu x2" and info.tp == 2
        assert len(info.throughput_decode) == 4 and min(info.throughput_decode) > 0
        assert list((cache_dir() / "profiles").glob(f"cpu-t*-tp2-*{spec.dtype}-4-b4*.json"))  # timed on the group
        assert len(records()) == 1  # one logical node, not one per rank
        (child,) = rank_children(peer.proc.pid)
        os.kill(child, signal.SIGKILL)
        wait_for(lambda: not peer.alive, "the group's rank 0 exits", timeout=60)
        assert peer.proc.returncode not in (0, None) and "tensor-parallel group failed" in peer.output()
        wait_for(lambda: peer.peer_id not in records(), "the record is gone", timeout=30)
    finally:
        if observer is not None:
            observer.shutdown()
        for p in (peer, boot_proc):
            if p is not None:
                p.stop()


def test_ranks_exit_when_rank_0_dies(model_dir):
    tp2, = start_peers(model_dir("llama"), [(0, 8)], "--tp", "2")
    try:
        (child,) = rank_children(tp2.proc.pid)
        os.kill(tp2.proc.pid, signal.SIGKILL)  # rank 0 alone, not its process group
        tp2.proc.wait(10)
        wait_for(lambda: not Path(f"/proc/{child}").exists() or b"zombie" in _status(child),
                   "the child rank exits with its parent", timeout=30)
    finally:
        tp2.stop()


def _status(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/status").read_bytes().lower()
    except FileNotFoundError:
        return b"zombie"


def _listening(pids: set[int]) -> list[str]:
    """The local addresses on which the processes ``pids`` hold listening TCP sockets."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN
                out.append(fields[1])
    return out


def test_the_group_listens_on_no_wildcard_address(model_dir):
    """The ranks meet through a file in a private directory, not through torch's TCP store
    (which listened on every interface and took writes from anyone), and their collectives stay on
    loopback: no process of the group listens on 0.0.0.0 or ::."""
    path = model_dir("llama")
    tp2, = start_peers(path, [(0, 8)], "--tp", "2", "--no-direct")
    try:
        group = {tp2.proc.pid, *rank_children(tp2.proc.pid)}
        addrs = _listening(group)
        wildcard = [a for a in addrs if a.split(":")[0] in ("00000000", "00000000000000000000000000000000")]
        assert not wildcard, addrs
        model = LocalModelInfo.load(path)
        ids = prompt(path, "Stay on loopback.")
        assert asyncio.run(run_chain(model, [tp2.hop()], ids, GREEDY)) == reference_generate(path, ids, GREEDY.max_new_tokens)
    finally:
        tp2.kill()
