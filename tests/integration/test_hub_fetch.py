"""What a peer fetches from a hub id, against ``p2pserve.testing.fake_hub.FakeHub``, in real
processes (each with its own ``HF_HOME``; the server counts what it sent to each):

* an unsupported family fails at once, naming the family, with nothing fetched but config.json;
* when a peer's range moves it fetches only the files it lacks and keeps the rest;
* offline (``HF_HUB_OFFLINE=1``, the server gone) it restarts from the cache under the same
  model name, serves what it holds, and says what is missing for a range it lacks;
* ``--revision`` pins a commit, and an unknown revision or repository is a clear error.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from p2pserve.model.family_configs import GEMMA_2_2B_IT
from p2pserve.model.spec import load_spec
from p2pserve.model.tiny_families import build_family_model
from p2pserve.testing.fake_hub import FakeHub, shard_by_layer
from tests.integration.processes import REPO

pytestmark = pytest.mark.integration

LAYER = "model-layer-{:02d}.safetensors"


def env_for(hub, label: str, tmp_path, **extra) -> dict[str, str]:
    return dict(os.environ, HF_HOME=str(tmp_path / f"hf-{label}"), HF_ENDPOINT=hub.endpoint_for(label),
                HF_HUB_OFFLINE="0", HF_HUB_DISABLE_TELEMETRY="1", P2PSERVE_CACHE=str(tmp_path / f"p2p-{label}"),
                **extra)


def fetch(env: dict, steps: list[dict]) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "tests.integration.hub_fetch", json.dumps(steps)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("HUB_FETCH "))
    return json.loads(line[len("HUB_FETCH "):])


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    root = tmp_path_factory.mktemp("hubfetch")
    tiny = shard_by_layer(build_family_model("mistral", root / "built", seed=0), root / "tiny")
    gemma = root / "gemma"
    gemma.mkdir()
    (gemma / "config.json").write_text(json.dumps(GEMMA_2_2B_IT))
    shutil.copy(tiny / "model-layer-00.safetensors", gemma / "model.safetensors")
    return {"acme/tiny": tiny, "acme/gemma": gemma}


def test_an_unsupported_family_fails_before_any_weight(repos, tmp_path):
    with FakeHub(repos) as hub:
        done = subprocess.run([sys.executable, "-m", "p2pserve.cli", "peer", "--model", "acme/gemma", "--layers", "0:2",
                               "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], cwd=REPO, capture_output=True, text=True,
                              timeout=120, env=env_for(hub, "peer", tmp_path))
        sent = dict(hub.file_bytes["peer"])
    assert done.returncode == 2, done.stderr[-2000:]
    assert "model family 'gemma2'" in done.stderr and "supported families" in done.stderr
    assert set(sent) == {"config.json"}


def test_a_moving_range_fetches_what_it_lacks_and_restarts_offline(repos, tmp_path):
    tiny = repos["acme/tiny"]
    want = load_spec(tiny).model_id
    with FakeHub(repos) as hub:
        online = env_for(hub, "peer", tmp_path)
        first, = fetch(online, [{"model": "acme/tiny", "ranges": [[4, 6], [2, 6], [3, 5]]}])
        commit = hub.repos["acme/tiny"].commit
        pinned, bad_rev, bad_repo = fetch(env_for(hub, "other", tmp_path), [
            {"model": f"acme/tiny@{commit}", "ranges": [[0, 1]]}, {"model": "acme/tiny@nope"}, {"model": "acme/none"}])
        sent = dict(hub.file_bytes["peer"])
    assert first["model_id"] == want
    assert first["fetched"] == [sorted([LAYER.format(4), LAYER.format(5), "model-head.safetensors"]),
                                [LAYER.format(2), LAYER.format(3)], []]
    assert sorted(hub.fetched["peer"]) == sorted(set(hub.fetched["peer"])), "a file was fetched twice"
    assert {n: b for n, b in sent.items() if n.endswith(".safetensors")} == {
        n: (tiny / n).stat().st_size for n in (LAYER.format(2), LAYER.format(3), LAYER.format(4), LAYER.format(5),
                                               "model-head.safetensors")}
    assert pinned["model_id"] == want and pinned["fetched"] == [sorted(["model-embed.safetensors", LAYER.format(0)])]
    assert "no revision 'nope'" in bad_rev["error"]
    assert "acme/none" in bad_repo["error"] and "neither a folder here nor a model on the hub" in bad_repo["error"]
    # the server is gone: the cache and the recorded listing are enough for the range held
    offline = dict(online, HF_HUB_OFFLINE="1")
    again, = fetch(offline, [{"model": "acme/tiny", "ranges": [[2, 6], [0, 2]]}])
    assert again.get("model_id") == want, again
    assert again["fetched"][0] == [] and "error" in again["fetched"][1]
