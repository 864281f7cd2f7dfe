"""A SIGKILLed peer, coordinator or client program leaves nothing running (``p2pserve/parent_watch.py``).

Each is started by hand, as an operator would (not through ``p2pserve.launch``, whose children
also watch their launcher), in a session of its own so that everything it starts can be found by
session id: its hivemind DHT process and the go-libp2p daemons (``p2pd``). Then only its main
process is SIGKILLed, as the OOM killer or a crash would, and nothing of its session may still run
20 s later. The client program exits by ``os._exit`` instead in one case: no cleanup runs either.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2pserve.cli.common import write_local_swarm_file
from p2pserve.client.model_info import LocalModelInfo

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
GRACE_S = 20.0
TIMING = dict(peer_refresh=0.5, candidate_refresh=0.5, plan_refresh=1.0, link_refresh=5.0, max_clock_skew=2.0)

CLIENT = """
import asyncio, os, sys
from p2pserve.client.api import AsyncClient
from p2pserve.config import DHTConfig

async def main():
    dht = DHTConfig(model=sys.argv[2], swarm_id="orphans", initial_peers=tuple(sys.argv[3].split()),
                    host_maddrs=("/ip4/127.0.0.1/tcp/0",), client_mode=True)
    client = AsyncClient(model=sys.argv[1], dht_config=dht)
    await client.start()
    print("CLIENT_READY", flush=True)
    if sys.argv[4] == "exit":
        os._exit(0)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def _session_members(sid: int) -> list[tuple[int, str]]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()
        if rest[0] not in ("Z", "X") and int(rest[3]) == sid:  # field 6 (session id)
            out.append((int(entry), name))
    return out


def _start(args: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    env.pop("P2PSERVE_PARENT_PID", None)
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _wait_for(log: Path, text: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if log.exists() and text in log.read_text(errors="replace"):
            return
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        time.sleep(0.2)
    raise TimeoutError(f"{text} not seen:\n" + log.read_text(errors="replace")[-3000:])


def _killed_leaves_nothing(proc: subprocess.Popen, how: str = "kill") -> list[tuple[int, str]]:
    sid = proc.pid
    members = _session_members(sid)
    assert any("p2pd" in name for _, name in members), members  # it did start a daemon
    if how == "kill":
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    end = time.monotonic() + GRACE_S
    while _session_members(sid) and time.monotonic() < end:
        time.sleep(0.5)
    return _session_members(sid)


@pytest.fixture(scope="module")
def swarm(model_dir, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("orphans")
    path = model_dir("llama")
    model = LocalModelInfo.load(path)
    boot = _start(["-m", "p2pserve.cli", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--maddrs-file",
                   str(logdir / "boot.maddrs")], logdir / "boot.log")
    try:
        end = time.monotonic() + 60
        while not (logdir / "boot.maddrs").exists() and time.monotonic() < end:
            time.sleep(0.2)
        maddrs = (logdir / "boot.maddrs").read_text().split()
        cfg = logdir / "swarm.json"
        write_local_swarm_file(cfg, model.spec, maddrs, "orphans", "/ip4/127.0.0.1/tcp/0", TIMING, 0.5)
        yield dict(path=path, cfg=cfg, logdir=logdir, maddrs=maddrs, model=model.spec.model_id)
    finally:
        os.killpg(boot.pid, signal.SIGKILL)
        boot.wait(10)


def _cleanup(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_killed_peer_leaves_nothing_running(swarm):
    log = swarm["logdir"] / "peer.log"
    proc = _start(["-m", "p2pserve.cli", "peer", "--model", swarm["path"], "--config", str(swarm["cfg"]), "--layers", "0:8",
                   "--num-threads", "1"], log)
    try:
        _wait_for(log, "P2PSERVE_PEER_READY", proc)
        assert _killed_leaves_nothing(proc) == []
    finally:
        _cleanup(proc)


def test_a_killed_coordinator_leaves_nothing_running(swarm):
    log = swarm["logdir"] / "coord.log"
    proc = _start(["-m", "p2pserve.cli", "coordinator", "--config", str(swarm["cfg"]), "--log-level", "INFO"], log)
    try:
        _wait_for(log, "coordinator", proc)
        time.sleep(3.0)  # its DHT node is up
        assert _killed_leaves_nothing(proc) == []
    finally:
        _cleanup(proc)


@pytest.mark.parametrize("how", ["kill", "exit"])
def test_a_client_program_that_dies_leaves_nothing_running(swarm, how):
    log = swarm["logdir"] / f"client-{how}.log"
    proc = _start(["-c", CLIENT, swarm["path"], swarm["model"], " ".join(swarm["maddrs"]),
                   "exit" if how == "exit" else "sleep"], log)
    try:
        if how == "exit":
            proc.wait(120)
            assert "CLIENT_READY" in log.read_text(errors="replace"), log.read_text(errors="replace")[-3000:]
            end = time.monotonic() + GRACE_S
            while _session_members(proc.pid) and time.monotonic() < end:
                time.sleep(0.5)
            assert _session_members(proc.pid) == []
        else:
            _wait_for(log, "CLIENT_READY", proc)
            assert _killed_leaves_nothing(proc) == []
    finally:
        _cleanup(proc)
