"""A swarm started from a hub model id, against a local server speaking the hub's file API.

The tiny Mistral (real-shaped config, untied head) is re-sharded one safetensors file per layer
and served by ``p2pserve.testing.fake_hub.FakeHub`` as ``acme/tiny-mistral``. A bootstrap node, a
coordinator and a client (its own process) take ``--model acme/tiny-mistral``; of three peers on
fixed ranges [0, 2), [2, 4), [4, 6), the first and last take the hub id and the middle one a
local copy of the same files, so the swarm is mixed and must still meet under one name. Every
process has its own ``HF_HOME`` and its own labelled endpoint, so the server counts what it sent
to each. The client's greedy tokens must equal transformers ``generate`` on the local copy, the
last peer must have fetched exactly the files of layers 4 and 5 and of the head, and the client
and the coordinator no weight file at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from p2pserve.client.model_info import LocalModelInfo
from p2pserve.launch import Child
from p2pserve.model.spec import load_spec
from p2pserve.model.tiny_families import build_family_model
from p2pserve.config.swarm_file import SwarmFile, Timing
from p2pserve.testing.fake_hub import FakeHub, shard_by_layer
from tests.harness import reference_generate
from tests.integration.processes import REPO

pytestmark = pytest.mark.integration

REPO_ID = "acme/tiny-mistral"
SWARM_ID = "hub-test"
TIMING = dict(peer_refresh=0.5, candidate_refresh=0.5, plan_refresh=2.0, link_refresh=2.0, max_clock_skew=2.0)
DEADLINE = 240.0  # a generous bound for a loaded two-core machine, not a performance claim
PEERS = {"first": ("hub", "0:2"), "middle": ("local", "2:4"), "last": ("hub", "4:6")}
MESSAGE = "Peer-to-peer serving splits a model's layers across many machines. What is the capital of France?"
NEW_TOKENS = 16


def wait_for(fn, what: str, procs=(), deadline: float = DEADLINE):
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        value = fn()
        if value:
            return value
        for p in procs:
            if not p.alive:
                raise RuntimeError(f"a process exited while waiting for {what}:\n{p.output()}")
        time.sleep(0.5)
    raise TimeoutError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    built = build_family_model("mistral", root / "built", seed=0)
    return shard_by_layer(built, root / "tiny-mistral")


def test_a_swarm_from_a_hub_id_fetches_only_what_each_role_needs(checkpoint, tmp_path):
    spec = load_spec(checkpoint)
    assert spec.num_layers == 6 and not spec.tie_word_embeddings
    local = LocalModelInfo.load(str(checkpoint))
    ids = local.chat_ids([{"role": "user", "content": MESSAGE}])
    want = reference_generate(str(checkpoint), ids, NEW_TOKENS)
    procs: dict[str, Child] = {}
    with FakeHub({REPO_ID: checkpoint}) as hub:
        def env(label: str) -> dict[str, str]:
            return {"HF_HOME": str(tmp_path / f"hf-{label}"), "HF_ENDPOINT": hub.endpoint_for(label),
                    "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1", "P2PSERVE_CACHE": str(tmp_path / "p2p")}

        def start(name: str, *args: str) -> Child:
            procs[name] = Child.spawn(name, list(args), log_path=tmp_path / f"{name}.log", env=env(name))
            return procs[name]

        try:
            maddrs = tmp_path / "boot.maddrs"
            start("boot", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--maddrs-file", str(maddrs))
            boot = wait_for(maddrs.exists, "bootstrap", procs.values()) and maddrs.read_text().split()
            swarm_file = tmp_path / "swarm.json"  # no model name in it: each role derives it from --model
            swarm_file.write_bytes(SwarmFile(swarm_id=SWARM_ID, initial_peers=tuple(boot),
                                             host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                                             timing=Timing(**TIMING)).to_json())
            start("coord", "coordinator", "--config", str(swarm_file), "--model", REPO_ID, "--solve-time-limit", "0.5")
            for name, (kind, layers) in PEERS.items():
                start(name, "peer", "--model", REPO_ID if kind == "hub" else str(checkpoint), "--config",
                      str(swarm_file), "--num-threads", "1", "--max-layers", "2", "--layers", layers)
            peer_ids = {name: wait_for(procs[name].ready, f"{name} ready", procs.values())["peer_id"]
                        for name in PEERS}
            client = subprocess.run(
                [sys.executable, "-m", "tests.integration.hub_client", json.dumps(dict(
                    boot=boot, model=REPO_ID, swarm_id=SWARM_ID, peer_ids=list(peer_ids.values()), message=MESSAGE,
                    new_tokens=NEW_TOKENS, deadline=DEADLINE))],
                cwd=REPO, env=dict(os.environ, **env("client")), capture_output=True, text=True, timeout=DEADLINE + 60)
            assert client.returncode == 0, client.stdout[-3000:] + client.stderr[-3000:]
            line = next(x for x in client.stdout.splitlines() if x.startswith("HUB_CLIENT "))
            result = json.loads(line[len("HUB_CLIENT "):])
        finally:
            for p in procs.values():
                p.stop(timeout=5)
        sizes = {f.name: f.stat().st_size for f in checkpoint.iterdir()}
        weights = {label: {n: b for n, b in got.items() if n.endswith(".safetensors")}
                   for label, got in hub.file_bytes.items()}
    # token-identical through a mixed swarm (hub id and local copy under one name)
    assert result["model_id"] == spec.model_id
    assert result["prompt_tokens"] == len(ids) and result["tokens"] == want
    assert [(peer, a, b) for peer, a, b in result["route"]] == [
        (peer_ids["first"], 0, 2), (peer_ids["middle"], 2, 4), (peer_ids["last"], 4, 6)]
    # the last third fetched its two layers and the head, each once and whole; nothing else
    expect_last = {"model-layer-04.safetensors", "model-layer-05.safetensors", "model-head.safetensors"}
    assert weights["last"] == {n: sizes[n] for n in expect_last}
    assert weights["first"] == {n: sizes[n] for n in ("model-embed.safetensors", "model-layer-00.safetensors",
                                                      "model-layer-01.safetensors")}
    assert "middle" not in hub.file_bytes  # the local copy never asks the hub
    for role in ("client", "coord"):  # configs, index and tokenizer only
        assert not weights.get(role), (role, weights.get(role))
        assert {"config.json", "tokenizer.json", "generation_config.json"} <= set(hub.file_bytes[role]), role
