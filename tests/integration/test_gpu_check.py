"""`scripts/gpu_check.sh --dry-run`: the GPU check end to end on the CPU with a tiny model.

The same script, driver and checks as on a GPU (random Llama-3-family model built in process,
a shard of every layer over a paged pool, transformers ``generate`` with a static cache as the
reference, the compiled layer parts traced by torch.compile); only the device, the model's size
and the compile backend differ. No timing is asserted, only that every figure is there and that
fp32 is token-identical to ``generate`` on both the eager and the compiled path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--tokens", "8",
                           "--streams", "8", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["dry_run"] is True
    bf16 = result["bf16"]
    for key in ("weight_read_ms", "batch1_ms_per_token", "streams8_over_1", "greedy_first_difference_vs_generate"):
        assert key in bf16
    assert bf16["compiled"]["deterministic"] is True
    assert result["fp32_identical"] is True
    assert result["fp32_compiled_identical"] is True
