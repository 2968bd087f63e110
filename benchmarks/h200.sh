#!/usr/bin/env bash
# The benchmarks of benchmarks/README.md on an H200 machine, from the repository root:
#   bash benchmarks/h200.sh tests      # build the kernels, then every GPU test
#   bash benchmarks/h200.sh layer      # one MoE layer beside every peer, all three shapes
#   bash benchmarks/h200.sh fp8        # the FP8 layer (every recipe, and auto) beside our bf16 layer
#   bash benchmarks/h200.sh e2e        # the 4-layer Qwen3-30B-A3B-shaped model vs HF transformers, bf16 vs FP8 loss curves
#   bash benchmarks/h200.sh callbacks  # recompute, CPU offload, CUDA graphs
#   bash benchmarks/h200.sh packed     # packed rows (varlen attention) vs one padded document per row
#   bash benchmarks/h200.sh long       # longest trainable sequence under a 48 GiB cap, ours vs HF
#   bash benchmarks/h200.sh multi      # 2+ GPUs: NCCL parity tests, EP scaling, the token exchange
#   bash benchmarks/h200.sh journey    # a wheel of the checkout, installed away from it: every recipe on one GPU,
#                                      # real-width slices of the full-size SFT recipes (benchmarks/journey.py)
# Results (JSON and logs) go to $RESULTS (default: results/).
set -euo pipefail
export PYTHONUNBUFFERED=1
RESULTS=${RESULTS:-results}
mkdir -p "$RESULTS"
PEERS=torch-grouped_mm-ref,hf-grouped_mm,mcore-sequential
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

journey() {
  # What a user does: build the wheel, install it into a fresh target, run from a folder outside the
  # repository with nothing of the repository on the path (the kernels build from the wheel's sources).
  local repo work site
  repo=$(pwd)
  work=${JOURNEY_DIR:-/tmp/lightning_moe_journey}
  rm -rf "$work" && mkdir -p "$work/wheel" "$work/site" "$work/run" "$work/src"
  # The wheel builds from a private copy, so two journeys of one checkout never share a build folder.
  tar -C "$repo" --exclude=./build --exclude=./.git --exclude="./$RESULTS" -cf - . | tar -C "$work/src" -xf -
  python3 -m pip wheel -q --no-deps --no-build-isolation -w "$work/wheel" "$work/src"
  python3 -m pip install -q --no-deps --no-index --target "$work/site" "$work"/wheel/lightning_moe-*.whl
  # Wheels of dependencies the machine lacks (jsonargparse, the CUTLASS headers), if brought along in .whl/.
  if compgen -G "$repo/.whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-deps --no-index --target "$work/site" "$repo"/.whl/*.whl
  fi
  cp "$repo/benchmarks/journey.py" "$work/journey.py"
  (
    cd "$work/run"
    export PYTHONPATH="$work/site" PATH="$work/site/bin:$PATH"
    python3 -c "import lightning_moe, sys; p = lightning_moe.__file__; print('installed package:', p); sys.exit(p.startswith('$repo'))"
    python3 -c "from lightning_moe.ops.build import load_extension; print('kernels:', load_extension('csrc'))"
    python3 -c "from lightning_moe.ops import build_cutlass as b; print('cutlass:', b.cutlass_unavailable_reason() or b.load_cutlass_extension())"
    python3 "$work/journey.py" --work "$work/run" --out "$RESULTS_ABS/journey.json" "$@"
  ) 2>&1 | tee "$RESULTS/journey.log"
}

if [ "${1:-layer}" = journey ]; then
  RESULTS_ABS=$(cd "$RESULTS" && pwd)
  shift
  journey "$@"
  exit "${PIPESTATUS[0]}"
fi

# Wheels of dependencies the machine lacks (jsonargparse, the CUTLASS headers), if brought along in .whl/.
if compgen -G ".whl/*.whl" >/dev/null; then
  deps=$(mktemp -d)
  python3 -m pip install -q --no-deps --no-index --target "$deps" .whl/*.whl
  export PYTHONPATH="$deps${PYTHONPATH:+:$PYTHONPATH}"
fi
# Build the kernels once, outside any timed step (the CUTLASS ones only when its headers are found).
python3 -c "from lightning_moe.ops.build import load_extension; print(load_extension('csrc'))"
python3 -c "from lightning_moe.ops import build_cutlass as b; print('cutlass:', b.cutlass_unavailable_reason() or b.load_cutlass_extension())"

case "${1:-layer}" in
  tests)
    # several workers share the one GPU (the kernels are built above, once)
    python3 -c "from lightning_moe.ops import build_cutlass as b; r = b.cutlass_unavailable_reason(); r and print('WARNING: the CUTLASS GPU tests will skip:', r)"
    python3 -m pytest tests/gpu -q -p no:cacheprovider -rfs -n "${GPU_TEST_WORKERS:-6}" | tee "$RESULTS/gpu_tests.log"
    ;;
  layer)
    python3 benchmarks/moe_layer.py --shapes qwen3-30b-a3b,deepseek-v3 --fuse-wgrad --peers "$PEERS" \
      --json "$RESULTS/moe_layer.json" | tee "$RESULTS/moe_layer.log"
    python3 benchmarks/moe_layer.py --shapes mixtral-8x7b --fuse-wgrad --no-breakdown --peers "$PEERS" \
      --json "$RESULTS/moe_layer_mixtral.json" | tee "$RESULTS/moe_layer_mixtral.log"
    ;;
  fp8)
    python3 benchmarks/fp8_layer.py --json "$RESULTS/fp8_layer.json" | tee "$RESULTS/fp8_layer.log"
    ;;
  e2e)
    python3 benchmarks/e2e.py --out "$RESULTS/e2e.json" | tee "$RESULTS/e2e.log"
    python3 benchmarks/e2e_loss_curve.py --out "$RESULTS/e2e_loss_curve.json" | tee "$RESULTS/e2e_loss_curve.log"
    ;;
  callbacks)
    python3 benchmarks/callbacks_bench.py --out "$RESULTS/callbacks.json" | tee "$RESULTS/callbacks.log"
    ;;
  packed)
    python3 -m pytest tests/gpu/test_varlen_attention_gpu.py -q -p no:cacheprovider -rs \
      | tee "$RESULTS/varlen_attention_gpu.log" || echo "h200.sh: varlen attention GPU tests failed; see the log" >&2
    python3 benchmarks/packed_vs_padded.py --out "$RESULTS/packed_vs_padded.json" | tee "$RESULTS/packed_vs_padded.log"
    ;;
  long)
    # each contender's search stops starting trials after 90 s (the bracket reached is reported)
    python3 benchmarks/long_context.py --cap-gib 48 --time-budget-s 90 --out "$RESULTS/long_context.json" \
      | tee "$RESULTS/long_context.log"
    ;;
  multi)
    N=$(nvidia-smi -L | wc -l)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
    LIGHTNING_MOE_TEST_ACCELERATOR=gpu LIGHTNING_MOE_PARITY_RTOL=1e-4 \
      python3 -m pytest tests/dist/test_dist_fit.py -k 2_ranks -q -p no:cacheprovider | tee "$RESULTS/dist_fit.log"
    # pipeline parallel over NCCL: PP2 (1f1b) and PP2 gpipe on two GPUs against the one-process CPU reference
    LIGHTNING_MOE_TEST_ACCELERATOR=gpu LIGHTNING_MOE_PARITY_RTOL=1e-4 \
      python3 -m pytest tests/dist/test_dist_pipeline_fit.py -k W2 -q -p no:cacheprovider | tee "$RESULTS/dist_pipeline.log"
    for d in alltoall alltoall_dedup; do
      torchrun --nproc_per_node="$N" benchmarks/ep_scaling.py --ep "$N" --dispatcher "$d" \
        --out "$RESULTS/ep${N}_$d.json" | tee "$RESULTS/ep${N}_$d.log"
    done
    torchrun --nproc_per_node="$N" benchmarks/ep_scaling.py --ep "$N" --skew 4 --echo-spare 8 \
      --out "$RESULTS/ep${N}_echo.json" | tee "$RESULTS/ep${N}_echo.log"
    dispatchers=alltoall,alltoall_dedup
    python3 -c "import deep_ep" 2>/dev/null && dispatchers=$dispatchers,deepep  # build: benchmarks/build_deepep.sh
    for shape in deepseek-v3 qwen3-30b-a3b; do
      torchrun --nproc_per_node="$N" benchmarks/dispatch_exchange.py --shape "$shape" --dispatchers "$dispatchers" \
        --check --out "$RESULTS/exchange_$shape.json" | tee "$RESULTS/exchange_$shape.log"
    done
    ;;
  *)
    echo "h200.sh: mode='$1' is not one of tests, layer, fp8, e2e, callbacks, packed, long, multi, journey; fix." >&2
    exit 2
    ;;
esac
