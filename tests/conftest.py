"""Shared fixtures: tiny seeded models and the embedded SmolLM2, built once per test run."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No test reaches the real Hugging Face Hub: hub ids resolve from the cache only, unless a test
# points a process at its own p2pserve.testing.fake_hub server (and turns this off there).
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """Factory: family name -> path of a tiny seeded model ('smollm2' -> the embedded default)."""
    from p2pserve.model.default import default_model_path
    from p2pserve.model.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    built: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in built:
            if family == "smollm2":
                built[family] = str(default_model_path())
            else:
                built[family] = str(build_tiny_model(family, root / family, seed=0))
        return built[family]

    return get
