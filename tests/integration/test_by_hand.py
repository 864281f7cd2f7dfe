"""A newcomer's swarm, started by hand from the public CLI, serves token-identical greedy output.

The scenario on a tiny Qwen2 checkpoint: ``p2pserve bootstrap``, ``p2pserve coordinator
--model PATH --initial-peers ...``, three ``p2pserve peer --model PATH --initial-peers ...
--device cpu`` and ``p2pserve.Client(initial_peers=[...], model=PATH)``. No swarm file, no
``--swarm-model``, no ``--num-layers``: ``--model PATH`` alone names the model on every role
(``p2pserve/model/identity.py``), and the coordinator reads the shape from the folder.

The second test gives the coordinator only a bare name (no folder): it takes the model's shape
from the peers' signed announcements (``p2pserve/coordinator/shape.py``).

Other flags, and why: ``--host-maddrs /ip4/127.0.0.1/tcp/0`` (loopback, a free port: tests run
side by side) and ``--maddrs-file`` (to learn the bootstrap's port); shorter refresh periods and
solve time (``TIMING_FLAGS``) only so that the swarm settles in seconds rather than a minute on
a loaded two-core machine; ``--num-threads 1`` (cores are shared). The client uses defaults.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from p2pserve.client.model_info import LocalModelInfo
from p2pserve.config import DHTConfig, PeerConfig
from p2pserve.launch import Children
from tests.harness import reference_generate
from tests.support import wait_for
from tests.support.swarm import SWARM_DEADLINE, LOOPBACK, MESSAGES, NEW_TOKENS, TIMING_FLAGS, chat_through, start_bootstrap

pytestmark = pytest.mark.integration

DEADLINE = 240.0  # generous bound for a loaded two-core machine, not a performance claim


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A tiny Qwen2 checkpoint, its tokenizer, and the reference tokens of ``MESSAGES``."""
    from p2pserve.model.tiny import build_tiny_model
    from p2pserve.peer.profiler import load_or_measure

    path = str(build_tiny_model("qwen2", tmp_path_factory.mktemp("by-hand") / "tiny-qwen2", seed=3))
    model = LocalModelInfo.load(path)
    # One profile for the three peers (they find it in the shared cache instead of each timing
    # its own forwards at once on two cores); the same key a peer with default flags asks for
    load_or_measure(path, model.spec, "cpu", model.spec.num_layers, PeerConfig().profile_batch)
    ids = model.chat_ids(MESSAGES)
    return path, model, ids, reference_generate(path, ids, NEW_TOKENS)


def start_swarm(tmp: Path, coordinator_model: str, peer_model: str, *peer_extra: str) -> tuple[Children, list[str]]:
    children = Children(tmp)
    boot = start_bootstrap(children, tmp)
    children.start("coord", "coordinator", "--model", coordinator_model, "--initial-peers", *boot,
                   "--host-maddrs", LOOPBACK, "--solve-time-limit", "0.5", *TIMING_FLAGS)
    for i in range(3):
        children.start(f"peer{i}", "peer", "--model", peer_model, "--initial-peers", *boot, "--device", "cpu",
                       "--host-maddrs", LOOPBACK, "--num-threads", "1", *peer_extra, *TIMING_FLAGS)
    return children, boot


def plan_serving_every_layer(boot: list[str], name: str, num_layers: int):
    """A reader (the test's instrument, not the client under test) waiting for a plan whose
    flows run over loaded ranges covering every layer."""
    from p2pserve.dht.swarm import Swarm

    observer = Swarm.create(DHTConfig(model=name, initial_peers=tuple(boot), host_maddrs=(LOOPBACK,), client_mode=True,
                                      num_layers=num_layers))

    def check():
        signed = asyncio.run(observer.get_plan())
        if signed is None or not signed.plan.flows or not signed.plan.spans:
            return None
        cover = signed.plan.coverage()
        return signed.plan if min(cover) > 0 else None

    return observer, check


def run_scenario(tmp: Path, qwen2, coordinator_model: str, peer_extra=(), client_kw=None, name=None):
    path, model, ids, ref = qwen2
    children, boot = start_swarm(tmp, coordinator_model, path, *peer_extra)
    observer = None
    try:
        observer, check = plan_serving_every_layer(boot, name or model.spec.model_id, model.spec.num_layers)
        plan = wait_for(check, "a plan serving every layer", SWARM_DEADLINE, interval=0.5, children=children)
        assert plan.num_layers == model.spec.num_layers
        reply = chat_through(boot, path, **(client_kw or {}))
        assert reply.tokens == ref, (reply.tokens, ref)
        return children
    except BaseException:
        for name_, child in children.procs.items():
            print(f"--- {name_}\n{child.output(3000)}")
        raise
    finally:
        if observer is not None:
            observer.shutdown()
        children.stop_all(timeout=5)


def test_model_path_alone_names_the_model_on_every_role(qwen2, tmp_path):
    children = run_scenario(tmp_path, qwen2, qwen2[0])
    assert "activation bytes/token" in (tmp_path / "coord.log").read_text()


def test_a_coordinator_given_a_bare_name_learns_the_shape_from_the_peers(qwen2, tmp_path):
    path, model, _, _ = qwen2
    run_scenario(tmp_path, qwen2, "tiny-qwen2-by-name", peer_extra=("--swarm-model", "tiny-qwen2-by-name"),
                 client_kw=dict(swarm_model="tiny-qwen2-by-name"), name="tiny-qwen2-by-name")
    log = (tmp_path / "coord.log").read_text()
    assert "model shape from the peers' announcements" in log
    assert f"{model.spec.num_layers} layers, {model.spec.activation_bytes_per_token} activation bytes/token" in log
