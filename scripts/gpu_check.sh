#!/usr/bin/env bash
# The engine on one CUDA GPU, in one command, on a machine without a package registry.
#
#   scripts/gpu_check.sh --build-wheelhouse [PYVER]  # here, with a registry: fill build/gpu-wheelhouse
#   scripts/gpu_check.sh                             # there: install what is missing, then measure
#   scripts/gpu_check.sh --dry-run                   # anywhere: the same on CPU, tiny model, ~1 min
#
# The wheelhouse holds the pure-Python and small binary dependencies the in-process check needs
# (transformers and its requirements, safetensors; at most 64 MiB), never torch: the GPU machine
# has its own. It is carried with the working tree (build/ is git-ignored: name it in what is
# carried). At run time a virtual environment with the system's site packages
# (build/gpu-venv) takes from the wheelhouse only what the system lacks, so the machine's torch
# is the one used. Measurements: benchmarks/gpu_check.py (its docstring), JSON in
# benchmarks/results/gpu_check.json (--out FILE), within 8 minutes (timeout).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHEELS=$ROOT/build/gpu-wheelhouse
PY=${PYTHON:-python3}

if [[ "${1:-}" == "--build-wheelhouse" ]]; then
  pyver=${2:-$($PY -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
  tf=$($PY -c 'import transformers; print(transformers.__version__)')
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  $PY -m pip download --quiet --only-binary=:all: --python-version "$pyver" --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any \
    -d "$WHEELS" "transformers==$tf" safetensors
  size=$(du -sm "$WHEELS" | cut -f1)
  echo "wheelhouse: $WHEELS, ${size} MiB, python $pyver"
  if (( size > 64 )); then echo "wheelhouse over 64 MiB" >&2; exit 1; fi
  exit 0
fi

need() {  # the modules the check imports that this python lacks
  "$1" - <<'EOF'
import importlib.util
missing = [m for m in ("transformers", "safetensors") if importlib.util.find_spec(m) is None]
if not missing:
    import transformers
    if int(transformers.__version__.split(".")[0]) < 5:  # the shard's fast path follows transformers 5
        missing.append("transformers")
print(" ".join(sorted(set(missing))))
EOF
}

RUN=$PY
if [[ -n "$(need "$PY")" ]]; then
  VENV=$ROOT/build/gpu-venv
  [[ -x $VENV/bin/python ]] || $PY -m venv --system-site-packages "$VENV"
  RUN=$VENV/bin/python
  missing=$(need "$RUN")
  if [[ -n "$missing" ]]; then
    [[ -d $WHEELS ]] || { echo "missing $missing and no wheelhouse at $WHEELS (run --build-wheelhouse where a registry is)" >&2; exit 1; }
    echo "installing $missing from $WHEELS"
    "$RUN" -m pip install --quiet --no-index --find-links "$WHEELS" $missing
  fi
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
exec timeout 480 "$RUN" benchmarks/gpu_check.py "$@"
