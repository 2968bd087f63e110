#!/usr/bin/env bash
# Everything the H200 runs in one call: kernels built and tested, then the layer benchmark.
# Usage (on the device machine, repo root): bash benchmarks/h200.sh [moe_layer.py args...]
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PWD:${PYTHONPATH:-}:/tmp/site"
else
  export PYTHONPATH="$PWD:${PYTHONPATH:-}"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
time python3 -c "from lightning_moe.ops.build import load_extension; print(load_extension('csrc'))" 2>&1 | tail -5
python3 -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
python3 benchmarks/moe_layer.py --json "$OUT/moe_layer.json" "$@" 2>&1 | tee "$OUT/moe_layer.log" | tail -45
