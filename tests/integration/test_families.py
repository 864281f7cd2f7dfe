"""Every supported family's real-shaped tiny checkpoint through three real peer processes.

Each folder is built by `p2pserve.model.tiny_families` from the family's real config.json
(Llama 3.2 with llama3 rope scaling, Qwen2.5, Qwen3, Mistral v0.3 with a sliding window, Phi-3.5
with longrope), saved sharded with generation_config.json and a chat template. Three peers serve
fixed ranges [0, 2), [2, 4), [4, 6) (no control plane); the public `p2pserve.Client` chats
through them, and its greedy tokens must equal transformers `generate` on the same folder. The
prompt and reply together outgrow Mistral's window and Phi-3.5's longrope switch (64 positions in
the tiny models), so the client's re-send at the switch and the peers' windowed masks are on
the path.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import p2pserve
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.model.family_configs import GEMMA_2_2B_IT
from p2pserve.model.tiny_families import build_family_model
from tests.harness import start_peers
from tests.integration.processes import REPO

pytestmark = pytest.mark.integration

FAMILIES = ["llama3", "qwen2.5", "qwen3", "mistral", "phi3.5"]
RANGES = [(0, 2), (2, 4), (4, 6)]
NEW_TOKENS = 32
MESSAGE = "Peer-to-peer serving splits a model's layers across many machines. What is the capital of France?"


def reference(path: str, ids: list[int], n: int) -> list[int]:
    """Greedy `generate` on the folder in fp32, without the generation_config's repetition
    penalty and EOS stop (the client applies neither; see docs/models.md)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         repetition_penalty=1.0, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_family_through_three_peers_matches_generate(tmp_path_factory, family):
    path = str(build_family_model(family, tmp_path_factory.mktemp(family) / family, seed=0))
    info = LocalModelInfo.load(path)
    ids = info.chat_ids([{"role": "user", "content": MESSAGE}])
    assert len(ids) < 64 < len(ids) + NEW_TOKENS, len(ids)  # crosses the window / longrope switch
    ref = reference(path, ids, NEW_TOKENS)
    peers = start_peers(path, RANGES)
    try:
        with p2pserve.Client(peers=[(p.maddrs[0], *p.layers) for p in peers], model=path) as client:
            reply = client.chat([{"role": "user", "content": MESSAGE}], max_new_tokens=NEW_TOKENS, ignore_eos=True)
        assert reply.prompt_tokens == len(ids)
        assert reply.tokens == ref
        assert [h.start for h in reply.route] == [0, 2, 4]
    finally:
        for p in peers:
            p.stop()


def test_a_peer_refuses_an_unsupported_family_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GEMMA_2_2B_IT))
    done = subprocess.run([sys.executable, "-m", "p2pserve.cli", "peer", "--model", str(tmp_path), "--layers", "0:2",
                           "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "model family 'gemma2'" in done.stderr and "supported families" in done.stderr
