#!/usr/bin/env bash
# The H200 runs, batched (device time is scarce). On the device machine, in the repo root:
#   bash benchmarks/h200.sh tests     # kernels built + every GPU test (-v, so a crash names its test)
#   bash benchmarks/h200.sh layer     # GPU kernel/layer tests + the MoE-layer race vs peers
#   bash benchmarks/h200.sh final     # kernel/layer GPU tests, deepseek + mixtral with fused wgrad accumulation (QWEN3=1: qwen3)
#   bash benchmarks/h200.sh offload   # activation offload GPU tests and OFFLOAD_RUNS (budget:prefetch ...) figures
#   bash benchmarks/h200.sh e2e       # end-to-end model race + callbacks / recompute figures
#   bash benchmarks/h200.sh verify    # graph-capture tests, GPU tests, kernels last, offload budgets, e2e (results_MODE.tgz)
#   bash benchmarks/h200.sh wgrad     # weight-gradient kernel tests + tile sweep (WGRAD_TILES=all/short/desc/none); layers with
#                                     # the best tile (WGRAD_TRITON_LAYERS=shapes), kernels, stream counts (WGRAD_LAYER_STREAMS)
#   bash benchmarks/h200.sh cutlass   # CUTLASS grouped wgrad: all GPU tests, kernel race vs cuBLAS, fused layers (CUTLASS_LAYERS)
#   bash benchmarks/h200.sh liger     # Liger alone with a long timeout; carry .tcache/ (from tcache.tgz) afterwards
#   bash benchmarks/h200.sh inlayer   # the fused wgrad kernels timed inside the DeepSeek-V3 step (INLAYER_ARMS)
#   bash benchmarks/h200.sh host      # the host's path to the first expert GEMM, stage by stage (qwen3, deepseek)
#   bash benchmarks/h200.sh probe     # CUTLASS wgrad race + its counters (ncu), router GEMM host cost, then GPU tests
#   bash benchmarks/h200.sh rows      # the bandwidth-bound kernels (scatter, gather-sum, SwiGLU) vs a copy; their tests
#   bash benchmarks/h200.sh close     # a session's last call: all GPU tests, then every shape beside every peer
#                                     # (CLOSE_FRESH=1: qwen3 with fresh gradients; CLOSE_PROBE=1: clock_probe.py on qwen3)
#   bash benchmarks/h200.sh blas      # the cuBLAS wgrad loop per BLAS back end (memsets?), a cold launch's host cost
#   bash benchmarks/h200.sh cold      # GPU tests, cold host µs per call after a sync, grouped GEMM layouts, qwen3 breakdown
#   bash benchmarks/h200.sh gemm      # CUTLASS grouped expert GEMM (forward/dgrad): its GPU tests, race vs F.grouped_mm
#   bash benchmarks/h200.sh race      # new pieces' GPU tests, host stages, GEMM + wgrad tiling races, qwen3 layer
#   bash benchmarks/h200.sh check     # all GPU tests, router GEMM tiles, Mixtral GEMM race, every shape beside torch's layer
#   bash benchmarks/h200.sh clocks    # GPU tests; SM clock + clock-event reasons per arm (benchmarks/clock_probe.py); qwen3 layer
#   bash benchmarks/h200.sh arms      # GEMM / wgrad kernel settings raced inside each shape's layer step (benchmarks/layer_arms.py)
#   bash benchmarks/h200.sh fresh     # GPU tests; fresh vs accumulated weight gradients inside the step; qwen3 layer both ways
#   bash benchmarks/h200.sh whatif    # qwen3 step with the bandwidth-bound kernels made free (fusion's upper bound) beside the GEMMs alone
#   bash benchmarks/h200.sh floor     # qwen3 step as the best fused design would run it (bytes it cannot avoid kept) beside the GEMMs alone
#   bash benchmarks/h200.sh peak      # the one-call path's tests, DeepSeek-V3 and Qwen3 beside torch's layer (time, activation peak)
#   bash benchmarks/h200.sh multi     # issue 8 on a multi-GPU kind: NCCL parity, EP scaling, overlap, ECHO, DeepEP
#                                     # (carry .deepep/: DeepEP's source as src.tar; built here by build_deepep.sh)
#   bash benchmarks/h200.sh all       # GPU tests, e2e with profile, callbacks, mixtral, Liger (results_MODE.tgz)
# Results land in $OUT (JSON + logs); the last lines printed are the summary tables.
# The kernel build (~1 min) is cached in .kcache/ (git-ignored) and also sent back as
# $OUT/kcache.tgz: unpack it into .kcache/ here and name .kcache in the next call's `carry`.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
export LIGHTNING_MOE_CACHE="$PWD/.kcache"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader
python3 -c "from lightning_moe.ops.build import load_extension; print(load_extension('csrc'))" 2>&1 | tail -2
# The optional CUTLASS kernels (built when nvidia-cutlass came in .whl/): built here, not inside a timed step.
[ "${1:-}" = multi ] || timeout 420 python3 -c "from lightning_moe.ops import build_cutlass as b; print('cutlass:', b.cutlass_unavailable_reason() or b.load_cutlass_extension())" 2>&1 | tail -1
# Triton's compiled kernels and autotuning results (Liger's fused MoE autotunes for minutes):
# kept in .tcache/ (git-ignored) like the kernel build; `liger` mode returns $OUT/tcache.tgz.
export TRITON_CACHE_DIR="$PWD/.tcache" TRITON_CACHE_AUTOTUNING=1
trap 'tar czf "$OUT/kcache.tgz" -C "$LIGHTNING_MOE_CACHE" . 2>/dev/null' EXIT
MODE=${1:-layer}
# One shape's step under labelled arms (benchmarks/layer_arms.py): NAME ARMS ROUNDS SECONDS -> $OUT/NAME.{json,log}.
step_arms() {
  timeout "$4" python3 benchmarks/layer_arms.py --shape "${SHAPE:-qwen3-30b-a3b}" --arms "$2" --rounds "$3" \
    --json "$OUT/$1.json" > "$OUT/$1.log" 2>&1; grep -h '^{' "$OUT/$1.log" | sed 's/, "env": {[^}]*}//' | cut -c1-200
  grep -hE "Error|error" "$OUT/$1.log" | tail -3; pack
}
pack() { (cd "$OUT" && tar czf "results_$MODE${TAG:-}.tgz" *.log *.json 2>/dev/null); }  # TAG: one archive per call of a mode  # what came back if a later step hangs
case "$MODE" in
  tests)
    timeout 240 python3 -m pytest tests/gpu -v -p no:cacheprovider -rf > "$OUT/gpu_tests.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|Fatal" "$OUT/gpu_tests.log" | tail -15; tail -3 "$OUT/gpu_tests.log"
    ;;
  layer)
    timeout 120 python3 -m pytest tests/gpu/test_kernels.py tests/gpu/test_layer_gpu.py -v -p no:cacheprovider -rf \
      > "$OUT/gpu_tests.log" 2>&1; tail -4 "$OUT/gpu_tests.log"
    timeout 300 python3 benchmarks/moe_layer.py --json "$OUT/moe_layer.json" > "$OUT/moe_layer.log" 2>&1
    timeout 80 python3 benchmarks/moe_layer.py --shapes qwen3-30b-a3b --skew 2 --peers torch-grouped_mm-ref,hf-grouped_mm \
      --no-breakdown --json "$OUT/moe_layer_skew.json" > "$OUT/moe_layer_skew.log" 2>&1
    grep -A60 "^device" "$OUT/moe_layer.log" | grep -v "^ \{20\}"; grep -A8 "^device" "$OUT/moe_layer_skew.log"
    ;;
  final)  # kernel + layer GPU tests; deepseek (+ fused wgrad, + keep) with breakdown; mixtral fused; QWEN3=1: qwen3
    [ "${FINAL_TESTS:-1}" = 1 ] && timeout 200 python3 -m pytest tests/gpu/test_kernels.py tests/gpu/test_layer_gpu.py \
      tests/gpu/test_wgrad_cutlass.py -q -p no:cacheprovider -rf > "$OUT/gpu_layer_tests.log" 2>&1
    grep -hE "FAILED|ERROR|Fatal" "$OUT/gpu_layer_tests.log" 2>/dev/null | tail -8; tail -1 "$OUT/gpu_layer_tests.log" 2>/dev/null
    timeout 240 python3 benchmarks/moe_layer.py --shapes deepseek-v3 --fuse-wgrad ${FINAL_KEEP---fuse-wgrad-keep} \
      --fuse-wgrad-kernels "${FINAL_KERNELS:-streams}" --peers torch-grouped_mm-ref --json "$OUT/deepseek.json" > "$OUT/deepseek.log" 2>&1
    grep -h '^{"peer\|^== \|peer ms /\|GEMMs alone fwd+bwd\|^ \{26\}' "$OUT/deepseek.log" | cut -c1-200; pack
    [ "${FINAL_MIXTRAL:-1}" = 1 ] && timeout 120 python3 benchmarks/moe_layer.py --shapes mixtral-8x7b --fuse-wgrad --no-breakdown \
      --fuse-wgrad-kernels "${FINAL_KERNELS:-streams}" \
      --peers "${MIXTRAL_PEERS:-torch-grouped_mm-ref}" --json "$OUT/mixtral.json" > "$OUT/mixtral.log" 2>&1
    grep -h '^{"peer\|^== \|peer ms /' "$OUT/mixtral.log" 2>/dev/null | cut -c1-200; pack
    [ -n "$QWEN3" ] && timeout 90 python3 benchmarks/moe_layer.py --shapes qwen3-30b-a3b --peers torch-grouped_mm-ref,hf-grouped_mm \
      --fuse-wgrad --json "$OUT/q.json" > "$OUT/q.log" 2>&1 && grep -h '^{"peer\|GEMMs alone fwd+bwd\|^ \{26\}' "$OUT/q.log" | cut -c1-200; pack
    (cd "$OUT" && rm -f *.log *.json)
    ;;
  offload)  # activation offload: callbacks GPU tests, then OFFLOAD_RUNS of budget:prefetch ("none" = no budget)
    timeout 60 python3 -m pytest tests/gpu/test_callbacks_gpu.py -v -p no:cacheprovider -rf -k "offload or recompute" \
      > "$OUT/gpu_cb_tests.log" 2>&1; grep -E "FAILED|ERROR|Fatal" "$OUT/gpu_cb_tests.log" | tail -8
    tail -1 "$OUT/gpu_cb_tests.log"
    for run in ${OFFLOAD_RUNS:-none:2 none:4}; do
      gib=${run%%:*}; arg="--offload-prefetch ${run##*:}"; [ "$gib" = none ] || arg="$arg --offload-max-gib $gib"
      echo "== offload budget $gib prefetch ${run##*:}"
      timeout 90 python3 benchmarks/callbacks_bench.py --arms offload $arg \
        --out "$OUT/offload_${gib}_${run##*:}.json" > "$OUT/offload_${gib}_${run##*:}.log" 2>&1
      tail -5 "$OUT/offload_${gib}_${run##*:}.log"; pack
    done
    (cd "$OUT" && rm -f *.log *.json)
    ;;
  e2e)
    timeout 150 python3 -m pytest tests/gpu/test_callbacks_gpu.py -q -p no:cacheprovider -rf > "$OUT/gpu_cb_tests.log" 2>&1
    tail -3 "$OUT/gpu_cb_tests.log"
    timeout 200 python3 benchmarks/e2e.py --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1; tail -12 "$OUT/e2e.log"
    timeout 200 python3 benchmarks/callbacks_bench.py --out "$OUT/callbacks.json" > "$OUT/callbacks.log" 2>&1
    tail -16 "$OUT/callbacks.log"
    ;;
  all)  # one call for everything after a fix round: tests, e2e (+profile), callbacks, mixtral, Liger last
    timeout 100 python3 -m pytest tests/gpu -v -p no:cacheprovider -rf > "$OUT/gpu_tests.log" 2>&1
    grep -E "FAILED|ERROR|Fatal" "$OUT/gpu_tests.log" | tail -12; tail -1 "$OUT/gpu_tests.log"
    timeout 170 python3 benchmarks/e2e.py --profile --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
    grep -E "^\[|^ratio" "$OUT/e2e.log"
    timeout 170 python3 benchmarks/callbacks_bench.py --out "$OUT/callbacks.json" > "$OUT/callbacks.log" 2>&1
    tail -20 "$OUT/callbacks.log"
    timeout 60 python3 benchmarks/callbacks_bench.py --arms offload --offload '*layers.*.ffn' \
      --out "$OUT/offload_ffn.json" > "$OUT/offload_ffn.log" 2>&1; tail -6 "$OUT/offload_ffn.log"
    timeout 80 python3 benchmarks/moe_layer.py --shapes mixtral-8x7b --peers torch-grouped_mm-ref,hf-grouped_mm \
      --json "$OUT/mixtral.json" > "$OUT/mixtral.log" 2>&1; grep -h '^{"peer\|^== ' "$OUT/mixtral.log" | cut -c1-160
    (cd "$OUT" && tar czf results_$MODE.tgz *.log *.json 2>/dev/null)
    timeout "${LIGER_S:-150}" python3 benchmarks/moe_layer.py --shapes qwen3-30b-a3b --peers liger-triton-fused --no-breakdown \
      --json "$OUT/liger.json" > "$OUT/liger.log" 2>&1; grep -h '^{"peer' "$OUT/liger.log" | cut -c1-160
    (cd "$OUT" && tar czf results_$MODE.tgz *.log *.json 2>/dev/null && rm -f *.log *.json)
    ;;
  verify)  # after a fix round: graph-capture tests alone, other GPU tests, kernels last; offload budgets; e2e
    timeout 60 python3 -m pytest tests/gpu/test_callbacks_gpu.py -k "captured_module or failed_capture" -v --tb=long \
      -p no:cacheprovider > "$OUT/graph_tests.log" 2>&1; grep -E "PASSED|FAILED|^E " "$OUT/graph_tests.log" | head -30
    timeout 90 python3 -m pytest tests/gpu/test_callbacks_gpu.py tests/gpu/test_layer_gpu.py -v -p no:cacheprovider -rf \
      > "$OUT/gpu_tests.log" 2>&1; grep -E "FAILED|ERROR|Fatal" "$OUT/gpu_tests.log" | tail -8; tail -1 "$OUT/gpu_tests.log"
    timeout 60 python3 -m pytest tests/gpu/test_kernels.py -v -p no:cacheprovider -rf > "$OUT/gpu_kernels.log" 2>&1
    grep -E "FAILED|ERROR|Fatal" "$OUT/gpu_kernels.log" | tail -8; tail -1 "$OUT/gpu_kernels.log"; pack
    for gib in ${OFFLOAD_GIB:-5 7}; do  # activation offload under a per-step budget (issue 6: <= +15 % step, >= -40 % peak)
      timeout 90 python3 benchmarks/callbacks_bench.py --arms offload --offload-max-gib $gib \
        --out "$OUT/offload_$gib.json" > "$OUT/offload_$gib.log" 2>&1; tail -5 "$OUT/offload_$gib.log"; pack
    done
    timeout 150 python3 benchmarks/e2e.py --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1; grep -E "^\[|^ratio" "$OUT/e2e.log"
    pack; (cd "$OUT" && rm -f *.log *.json)
    ;;
  multi)  # issue 8 on nvidia-h200-x2 (-x4/-x8): one GPU per rank, NVLink multicast off; carry .deepep/ for DeepEP
    N=$(nvidia-smi -L | wc -l); DEADLINE=${MULTI_S:-560}
    left() { local s=$((DEADLINE - SECONDS)); [ "$s" -gt "$1" ] && echo "$1" || echo $((s > 5 ? s : 5)); }
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
    nvidia-smi topo -m > "$OUT/topo.log" 2>&1; cat "$OUT/topo.log"
    if [ -f .deepep/src.tar ] && ! python3 -c "import deep_ep" 2>/dev/null; then  # CPU-bound: runs beside the GPU work
      bash benchmarks/build_deepep.sh "$OUT" > "$OUT/deepep_build.log" 2>&1 &
      BUILD=$!
    fi
    for nvtx in $(find / -xdev -name 'libnvtx3interop.so*' 2>/dev/null | head -1); do
      export LD_LIBRARY_PATH="$(dirname "$nvtx"):${LD_LIBRARY_PATH:-}"; done
    # NCCL parity: the Trainer.fit layouts of tests/dist for this world size (fp32 and bf16-mixed) vs the one-process reference
    LIGHTNING_MOE_TEST_ACCELERATOR=gpu LIGHTNING_MOE_PARITY_RTOL=1e-4 timeout "$(left 200)" python3 -m pytest \
      tests/dist/test_dist_fit.py -k "${N}_ranks" -v -p no:cacheprovider -rf > "$OUT/nccl_parity.log" 2>&1
    grep -E "PASSED|FAILED|ERROR" "$OUT/nccl_parity.log" | cut -c1-160; tail -1 "$OUT/nccl_parity.log"; pack
    [ -n "${BUILD:-}" ] && { timeout "$(left 300)" tail --pid="$BUILD" -f /dev/null; tail -3 "$OUT/deepep_build.log"; }
    for shape in deepseek-v3 qwen3-30b-a3b; do  # parity (closed form) and bandwidth of every dispatcher
      for ds in alltoall,alltoall_dedup,deepep hybridep; do  # Hybrid-EP alone: a crash there loses nothing else
        PYTHONFAULTHANDLER=1 timeout "$(left 90)" torchrun --nproc_per_node="$N" benchmarks/dispatch_exchange.py \
          --shape "$shape" --dispatchers "$ds" --check --out "$OUT/exchange_${shape}_${ds%%,*}.json" \
          > "$OUT/exchange_${shape}_${ds%%,*}.log" 2>&1; echo "exchange $shape $ds rc=$?"
        grep -E '^\{' "$OUT/exchange_${shape}_${ds%%,*}.log" | cut -c1-420
        grep -E "parity failed|Error|Fatal|File \"" "$OUT/exchange_${shape}_${ds%%,*}.log" | head -8 | cut -c1-200
      done
    done
    pack
    for ep in ${MULTI_EPS:-1 2 4 8}; do
      [ "$ep" -le "$N" ] || continue
      timeout "$(left 90)" torchrun --nproc_per_node="$ep" benchmarks/ep_scaling.py --ep "$ep" --out "$OUT/ep$ep.json" \
        > "$OUT/ep$ep.log" 2>&1 || tail -5 "$OUT/ep$ep.log"
      grep -E '"(step_ms|tflops_per_gpu|a2a_share)"' "$OUT/ep$ep.json"
    done
    for d in alltoall_dedup deepep hybridep; do  # EP over every GPU with each exchange
      echo "== ep_scaling --dispatcher $d"
      timeout "$(left 80)" torchrun --nproc_per_node="$N" benchmarks/ep_scaling.py --dispatcher $d --out "$OUT/$d.json" \
        > "$OUT/$d.log" 2>&1 || grep -E "Error|error|Fatal" "$OUT/$d.log" | tail -3
      grep -E '"(step_ms|tflops_per_gpu|a2a_share)"' "$OUT/$d.json" 2>/dev/null
    done
    pack
    for d in ${ECHO_DISPATCHERS:-alltoall alltoall_dedup}; do  # ECHO under a skewed router: load and step, with and without
      for spare in ${ECHO_SPARES:-8}; do
        echo "== ECHO --dispatcher $d --skew 4 --echo-spare $spare"
        timeout "$(left 100)" torchrun --nproc_per_node="$N" benchmarks/ep_scaling.py --dispatcher "$d" --skew 4 \
          --echo-spare "$spare" --out "$OUT/echo_${d}_$spare.json" > "$OUT/echo_${d}_$spare.log" 2>&1 \
          || tail -5 "$OUT/echo_${d}_$spare.log"
        grep -E '"(rank_load_max_over_mean_plain|rank_load_max_over_mean_echo|echo_step_ms|step_ms)"' "$OUT/echo_${d}_$spare.json"
      done
    done
    for flag in ${SHARED_RUNS-"" "--overlap-shared"}; do  # shared expert (Qwen3-style width 1536 is illustrative)
      timeout "$(left 80)" torchrun --nproc_per_node="$N" benchmarks/ep_scaling.py --shared-expert-ffn 1536 $flag \
        --out "$OUT/shared${flag:+_overlap}.json" > "$OUT/shared${flag:+_overlap}.log" 2>&1 || tail -5 "$OUT/shared${flag:+_overlap}.log"
      grep -E '"(step_ms|a2a_share)"' "$OUT/shared${flag:+_overlap}.json"
    done
    pack; (cd "$OUT" && rm -f *.log *.json)
    ;;
  wgrad)  # weight-gradient kernels (tests, every tile vs the cuBLAS loop), then deepseek with the best tile
    [ "${WGRAD_TESTS:-1}" = 1 ] && timeout 150 python3 -m pytest tests/gpu/test_layer_gpu.py -q -p no:cacheprovider -rf -k wgrad \
      > "$OUT/gpu_wgrad_tests.log" 2>&1; grep -hE "FAILED|ERROR|Fatal" "$OUT/gpu_wgrad_tests.log" | tail -8
    tail -1 "$OUT/gpu_wgrad_tests.log" 2>/dev/null
    timeout 240 python3 benchmarks/wgrad_kernels.py --shapes ${WGRAD_SHAPES:-deepseek-v3 mixtral-8x7b} \
      --tiles "${WGRAD_TILES:-all}" --json "$OUT/wgrad.json" > "$OUT/wgrad.log" 2>&1; grep -v '"triton' "$OUT/wgrad.log" | cut -c1-200
    python3 - "$OUT/wgrad.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
for r in sorted((r for r in rows if r["arm"].startswith("triton")), key=lambda r: (r["weight"], r["ms"])):
    print(f'{r["weight"]:18s} {r["arm"]:34s} {r["ms"]:8.3f} ms {r["grad_rw_tb_s"]:5.2f} TB/s err {r["max_rel_err"]:.1e}')
PY
    pack
    for shape in ${WGRAD_TRITON_LAYERS:-}; do  # the layer with the sweep's best Triton tile for that shape
      tile=$(grep -h "^best $shape" "$OUT/wgrad.log" | sed 's/.*tile=//')
      [ -z "$tile" ] && continue
      echo "== $shape layer, LIGHTNING_MOE_WGRAD_KERNEL=triton LIGHTNING_MOE_WGRAD_TILE=$tile"
      LIGHTNING_MOE_WGRAD_KERNEL=triton LIGHTNING_MOE_WGRAD_TILE="$tile" timeout 200 python3 benchmarks/moe_layer.py \
        --shapes "$shape" --fuse-wgrad --peers torch-grouped_mm-ref --json "$OUT/${shape}_triton.json" > "$OUT/${shape}_triton.log" 2>&1
      grep -h '^{"peer\|peer ms /\|GEMMs alone fwd+bwd\|^ \{26\}' "$OUT/${shape}_triton.log" | cut -c1-400; pack
    done
    for k in ${WGRAD_LAYER_KERNELS:-}; do  # the deepseek layer with each accumulation kernel
      echo "== LIGHTNING_MOE_WGRAD_KERNEL=$k"
      LIGHTNING_MOE_WGRAD_KERNEL=$k timeout 150 python3 benchmarks/moe_layer.py --shapes deepseek-v3 --fuse-wgrad \
        --fuse-wgrad-keep --no-breakdown --peers torch-grouped_mm-ref --json "$OUT/deepseek_$k.json" > "$OUT/deepseek_$k.log" 2>&1
      grep -h '^{"peer\|peer ms /' "$OUT/deepseek_$k.log" | cut -c1-200; pack
    done
    i=0
    for streams in ${WGRAD_LAYER_STREAMS:-}; do  # the deepseek layer with each LIGHTNING_MOE_WGRAD_STREAMS
      i=$((i + 1)); echo "== LIGHTNING_MOE_WGRAD_STREAMS=$streams"
      LIGHTNING_MOE_WGRAD_STREAMS=$streams timeout 120 python3 benchmarks/moe_layer.py --shapes deepseek-v3 --fuse-wgrad \
        --no-breakdown --peers "${STREAMS_PEERS:-none}" --json "$OUT/deepseek_s$i.json" > "$OUT/deepseek_s$i.log" 2>&1
      grep -h '^{"peer\|peer ms /' "$OUT/deepseek_s$i.log" | cut -c1-200; pack
    done
    (cd "$OUT" && rm -f *.log *.json)
    ;;
  cutlass)  # the CUTLASS grouped wgrad (carry .whl/ with nvidia-cutlass): every GPU test, kernel race, layers
    if [ "${CUTLASS_TESTS:-all}" = quick ]; then  # its own tests and the layer's wgrad ones
      timeout 150 python3 -m pytest tests/gpu/test_wgrad_cutlass.py tests/gpu/test_layer_gpu.py -k "wgrad or cutlass" -q \
        -p no:cacheprovider -rf > "$OUT/gpu_tests.log" 2>&1
    else
      timeout 280 python3 -m pytest tests/gpu -q -p no:cacheprovider -rf > "$OUT/gpu_tests.log" 2>&1
    fi
    grep -hE "FAILED|ERROR|Fatal" "$OUT/gpu_tests.log" | tail -8; tail -1 "$OUT/gpu_tests.log"; pack
    timeout 150 python3 benchmarks/wgrad_kernels.py --shapes ${WGRAD_SHAPES:-deepseek-v3 qwen3-30b-a3b} --tiles none \
      --cutlass-only --json "$OUT/wgrad.json" > "$OUT/wgrad.log" 2>&1; grep -E '"arm"|^best' "$OUT/wgrad.log" | cut -c1-160; pack
    for shape in ${CUTLASS_LAYERS:-qwen3-30b-a3b deepseek-v3}; do  # each layer with its shape's best tiling
      tiling=$(grep -h "^best cutlass $shape" "$OUT/wgrad.log" | sed 's/.*tiling=//')
      echo "== $shape, LIGHTNING_MOE_WGRAD_CUTLASS_TILE=${tiling:-default}"
      LIGHTNING_MOE_WGRAD_CUTLASS_TILE=${tiling:-cooperative} timeout "${CUTLASS_LAYER_S:-150}" python3 benchmarks/moe_layer.py \
        --shapes "$shape" --fuse-wgrad --peers torch-grouped_mm-ref --json "$OUT/layer_$shape.json" > "$OUT/layer_$shape.log" 2>&1
      grep -A40 "^device" "$OUT/layer_$shape.log" | grep -v "^ \{28\}" | cut -c1-250; pack
    done
    ;;
  inlayer)  # wgrad kernels inside the layer step, arms interleaved (benchmarks/wgrad_in_layer.py)
    timeout 200 python3 benchmarks/wgrad_in_layer.py --shape "${SHAPE:-deepseek-v3}" --rounds 4 \
      --arms "${INLAYER_ARMS:-streams,cutlass@cooperative-c1x2,w2=cutlass@cooperative-c1x2}" \
      --json "$OUT/inlayer.json" > "$OUT/inlayer.log" 2>&1; tail -6 "$OUT/inlayer.log" | cut -c1-220; pack
    ;;
  host)  # host µs from the step's start to each forward stage, then a cProfile of qwen3's steps
    timeout 150 python3 benchmarks/host_path.py --shapes "${SHAPES:-qwen3-30b-a3b,deepseek-v3}" --fuse-wgrad --stages \
      > "$OUT/host.log" 2>&1; grep -h '^{' "$OUT/host.log" | cut -c1-900
    timeout 90 python3 benchmarks/host_path.py --shapes qwen3-30b-a3b --fuse-wgrad --profile-host 20 \
      > "$OUT/host_profile.log" 2>&1; grep -A45 "== host profile" "$OUT/host_profile.log" | cut -c1-180; pack
    ;;
  probe)  # where the wgrad kernels' time goes: race, in-layer arms, ncu counters, router host cost, tests
    timeout 150 python3 benchmarks/wgrad_kernels.py --shapes ${WGRAD_SHAPES:-deepseek-v3 qwen3-30b-a3b} --tiles none \
      --cutlass-only --json "$OUT/wgrad.json" > "$OUT/wgrad.log" 2>&1; grep -E '"arm"|^best' "$OUT/wgrad.log" | cut -c1-160; pack
    timeout 150 python3 benchmarks/wgrad_in_layer.py --shape deepseek-v3 --rounds 3 \
      --arms "${INLAYER_ARMS:-streams,cutlass@cooperative-c1x2}" \
      --json "$OUT/inlayer.json" > "$OUT/inlayer.log" 2>&1; tail -7 "$OUT/inlayer.log" | cut -c1-220; pack
    for arm in ${NCU_ARMS:-cutlass:cooperative-c1x2 grouped-fresh}; do
      echo "== ncu deepseek-v3 w13 $arm"
      timeout 100 ncu --clock-control none -k regex:device_kernel --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        --section WarpStateStats --section LaunchStats --section Occupancy \
        python3 benchmarks/wgrad_counters.py --shape deepseek-v3 --weight w13 --arm "$arm" > "$OUT/ncu_${arm#*:}.log" 2>&1
      grep -E "Throughput|Duration|Busy|Pipe|Warp Cycles|Stall|Registers|Shared Memory Config|Achieved Occ|Block Limit|Hit Rate|Bandwidth|Elapsed Cycles|Issued" \
        "$OUT/ncu_${arm#*:}.log" | cut -c1-130 | head -45; pack
    done
    timeout 120 python3 benchmarks/host_path.py --shapes qwen3-30b-a3b --fuse-wgrad --router-variants \
      > "$OUT/host.log" 2>&1; grep -h '^{' "$OUT/host.log" | cut -c1-1500; pack
    timeout "${PROBE_TESTS_S:-200}" python3 -m pytest tests/gpu -q -p no:cacheprovider -rf > "$OUT/gpu_tests.log" 2>&1
    grep -hE "FAILED|ERROR|Fatal" "$OUT/gpu_tests.log" | tail -8; tail -1 "$OUT/gpu_tests.log"; pack
    ;;
  rows)  # the bandwidth-bound kernels' TB/s against a copy, then their GPU tests
    timeout 90 python3 benchmarks/row_kernels.py --json "$OUT/rows.json" > "$OUT/rows.log" 2>&1
    grep -h '^{' "$OUT/rows.log" | cut -c1-160
    timeout 120 python3 -m pytest tests/gpu/test_kernels.py -q -p no:cacheprovider -rf \
      -k "swiglu or scatter or unpermute or permute" > "$OUT/rows_tests.log" 2>&1
    grep -hE "FAILED|ERROR" "$OUT/rows_tests.log" | tail -4; tail -1 "$OUT/rows_tests.log"; pack
    ;;
  blas)  # the two-stream cuBLAS wgrad loop under cublas / cublaslt, with what it runs; cold host cost of launches
    timeout 150 python3 benchmarks/wgrad_blas.py --shape deepseek-v3 > "$OUT/blas.log" 2>&1; grep -h '^{' "$OUT/blas.log" | cut -c1-700
    ROUTER_VARIANTS_DEFAULT_ONLY=1 timeout 100 python3 benchmarks/host_path.py --shapes qwen3-30b-a3b --fuse-wgrad \
      --router-variants > "$OUT/host.log" 2>&1; grep -h '^{' "$OUT/host.log" | cut -c1-900; pack
    ;;
  close)  # all GPU tests; qwen3 + deepseek (breakdown, GEMMs alone) and mixtral beside torch, HF and Megatron-Core
    if [ "${CLOSE_TESTS:-1}" = 1 ]; then
      timeout "${CLOSE_TESTS_S:-180}" python3 -m pytest tests/gpu -q -p no:cacheprovider -rf > "$OUT/gpu_tests.log" 2>&1
      grep -hE "FAILED|ERROR|Fatal" "$OUT/gpu_tests.log" | tail -8; tail -1 "$OUT/gpu_tests.log"; pack
    fi
    peers=${CLOSE_PEERS:-torch-grouped_mm-ref,hf-grouped_mm,mcore-sequential}
    timeout 230 python3 benchmarks/moe_layer.py --shapes qwen3-30b-a3b,deepseek-v3 --fuse-wgrad --peers "$peers" \
      --json "$OUT/layers.json" > "$OUT/layers.log" 2>&1
    grep -h '^{"peer\|peer ms /\|GEMMs alone fwd+bwd\|^ \{26\}' "$OUT/layers.log" | cut -c1-220; pack
    [ "${CLOSE_MIXTRAL:-1}" = 1 ] && timeout 100 python3 benchmarks/moe_layer.py --shapes mixtral-8x7b --fuse-wgrad \
      --no-breakdown --peers "$peers" --json "$OUT/mixtral.json" > "$OUT/mixtral.log" 2>&1
    grep -h '^{"peer\|peer ms /' "$OUT/mixtral.log" 2>/dev/null | cut -c1-200; pack
    if [ "${CLOSE_FRESH:-0}" = 1 ]; then  # qwen3 again with every .grad None each step (no accumulation)
      timeout 100 python3 benchmarks/moe_layer.py --shapes qwen3-30b-a3b --fuse-wgrad --fresh-grads \
        --peers torch-grouped_mm-ref,hf-grouped_mm --json "$OUT/fresh.json" > "$OUT/fresh.log" 2>&1
      grep -h '^{"peer\|peer ms /\|GEMMs alone fwd+bwd' "$OUT/fresh.log" | cut -c1-220; pack
    fi
    if [ "${CLOSE_PROBE:-0}" = 1 ]; then  # clock, power, reasons and joules a step per arm (qwen3)
      timeout 120 python3 benchmarks/clock_probe.py --shape qwen3-30b-a3b --seconds 2 > "$OUT/clocks.log" 2>&1
      cut -c1-420 "$OUT/clocks.log" | tail -9; pack
    fi
    ;;
  cold)  # all GPU tests; cold host cost per call after a sync; grouped GEMM layouts; qwen3 breakdown
    timeout 200 python3 -m pytest tests/gpu -q -p no:cacheprovider -rf > "$OUT/gpu_tests.log" 2>&1
    grep -hE "FAILED|ERROR|Fatal" "$OUT/gpu_tests.log" | tail -8; tail -1 "$OUT/gpu_tests.log"; pack
    timeout 120 python3 benchmarks/host_path.py --shapes qwen3-30b-a3b --fuse-wgrad --stages --cold-sequence \
      > "$OUT/host.log" 2>&1; grep -h '^{' "$OUT/host.log" | cut -c1-1200; pack
    timeout 120 python3 benchmarks/expert_gemms.py --shapes qwen3-30b-a3b deepseek-v3 --dgrad --no-loops \
      --json "$OUT/gemms.json" > "$OUT/gemms.log" 2>&1; grep -h '^{' "$OUT/gemms.log" | cut -c1-160; pack
    timeout 150 python3 benchmarks/moe_layer.py --shapes qwen3-30b-a3b --fuse-wgrad --peers torch-grouped_mm-ref \
      --json "$OUT/layers.json" > "$OUT/layers.log" 2>&1
    grep -h '^{"peer\|peer ms /\|GEMMs alone fwd+bwd' "$OUT/layers.log" | cut -c1-220; pack
    ;;
  gemm)  # the CUTLASS grouped expert GEMM (carry .whl/ with nvidia-cutlass): its tests, every tiling vs F.grouped_mm
    timeout 200 python3 -m pytest tests/gpu/test_grouped_gemm_cutlass.py -q -p no:cacheprovider -rf \
      > "$OUT/gpu_gemm_tests.log" 2>&1; grep -hE "FAILED|ERROR|Fatal" "$OUT/gpu_gemm_tests.log" | tail -8
    tail -1 "$OUT/gpu_gemm_tests.log"; pack
    timeout 200 python3 benchmarks/expert_gemms.py --shapes qwen3-30b-a3b deepseek-v3 --dgrad --no-loops \
      --json "$OUT/gemms.json" > "$OUT/gemms.log" 2>&1; grep -h '^{' "$OUT/gemms.log" | cut -c1-200; pack
    ;;
  race)  # new pieces' GPU tests; host stages; expert GEMM and wgrad tilings raced; qwen3 layer beside torch
    timeout 240 python3 -m pytest tests/gpu/test_route.py tests/gpu/test_grouped_gemm_cutlass.py tests/gpu/test_wgrad_cutlass.py \
      tests/gpu/test_kernels.py tests/gpu/test_layer_gpu.py -q -p no:cacheprovider -rf > "$OUT/gpu_tests.log" 2>&1
    grep -hE "FAILED|ERROR|Fatal" "$OUT/gpu_tests.log" | tail -12; tail -1 "$OUT/gpu_tests.log"; pack
    timeout 90 python3 benchmarks/host_path.py --shapes qwen3-30b-a3b --fuse-wgrad --stages \
      > "$OUT/host.log" 2>&1; grep -h '^{' "$OUT/host.log" | cut -c1-1200; pack
    timeout 150 python3 benchmarks/expert_gemms.py --shapes qwen3-30b-a3b deepseek-v3 --dgrad --no-loops \
      --json "$OUT/gemms.json" > "$OUT/gemms.log" 2>&1; grep -h '^{' "$OUT/gemms.log" | cut -c1-200; pack
    timeout 120 python3 benchmarks/wgrad_kernels.py --shapes deepseek-v3 qwen3-30b-a3b --tiles none --cutlass-only \
      --json "$OUT/wgrad.json" > "$OUT/wgrad.log" 2>&1; grep -E '"arm"|^best' "$OUT/wgrad.log" | cut -c1-160; pack
    timeout 100 python3 benchmarks/moe_layer.py --shapes qwen3-30b-a3b --fuse-wgrad --peers torch-grouped_mm-ref \
      --json "$OUT/layers.json" > "$OUT/layers.log" 2>&1
    grep -h '^{"peer\|peer ms /\|GEMMs alone fwd+bwd' "$OUT/layers.log" | cut -c1-220; pack
    ;;
  check)  # all GPU tests; router GEMM tiles vs cuBLAS; Mixtral's GEMM race; every shape beside torch's layer
    timeout 200 python3 -m pytest tests/gpu -q -p no:cacheprovider -rf > "$OUT/gpu_tests.log" 2>&1
    grep -hE "FAILED|ERROR|Fatal" "$OUT/gpu_tests.log" | tail -12; tail -1 "$OUT/gpu_tests.log"; pack
    timeout 60 python3 benchmarks/router_gemm.py > "$OUT/router_gemm.log" 2>&1; grep -h '^{' "$OUT/router_gemm.log"; pack
    timeout 100 python3 benchmarks/expert_gemms.py --shapes mixtral-8x7b --dgrad --no-loops \
      --json "$OUT/gemms.json" > "$OUT/gemms.log" 2>&1; grep -h '^{' "$OUT/gemms.log" | grep -v "128x128" | cut -c1-200; pack
    CLOSE_TESTS=0 CLOSE_PEERS=${CLOSE_PEERS:-torch-grouped_mm-ref} bash "$0" close
    ;;
  peak)  # the one-call path's tests, then DeepSeek-V3 (and Qwen3) beside torch's layer: time and activation peak
    timeout 120 python3 -m pytest tests/gpu/test_route.py tests/gpu/test_layer_gpu.py -q -p no:cacheprovider -rf \
      > "$OUT/gpu_tests.log" 2>&1; grep -hE "FAILED|ERROR|Fatal" "$OUT/gpu_tests.log" | tail -8; tail -1 "$OUT/gpu_tests.log"
    timeout 150 python3 benchmarks/moe_layer.py --shapes "${SHAPES:-deepseek-v3,qwen3-30b-a3b}" --fuse-wgrad --no-breakdown \
      --peers torch-grouped_mm-ref --json "$OUT/peak.json" > "$OUT/peak.log" 2>&1; grep -h '^{"peer\|peer ms /' "$OUT/peak.log" | cut -c1-200
    ;;
  clocks)  # all GPU tests; each arm's SM clock, power and clock-event reasons; synced vs back-to-back steps; qwen3 layer
    timeout 200 python3 -m pytest tests/gpu -q -p no:cacheprovider -rf > "$OUT/gpu_tests.log" 2>&1
    grep -hE "FAILED|ERROR|Fatal" "$OUT/gpu_tests.log" | tail -12; tail -1 "$OUT/gpu_tests.log"; pack
    for shape in ${SHAPES:-qwen3-30b-a3b}; do
      timeout 150 python3 benchmarks/clock_probe.py --shape "$shape" --seconds "${CLOCK_S:-2}" \
        > "$OUT/clocks_$shape.log" 2>&1; cut -c1-400 "$OUT/clocks_$shape.log" | tail -12; pack
    done
    timeout 100 python3 benchmarks/moe_layer.py --shapes qwen3-30b-a3b --fuse-wgrad --peers torch-grouped_mm-ref \
      --json "$OUT/layers.json" > "$OUT/layers.log" 2>&1
    grep -h '^{"peer\|peer ms /\|GEMMs alone fwd+bwd\|^ \{26\}' "$OUT/layers.log" | cut -c1-220; pack
    ;;
  arms)  # kernel settings raced inside the layer step (benchmarks/layer_arms.py), every shape; GPU tests last
    G=LIGHTNING_MOE_GEMM_KERNEL=cutlass+LIGHTNING_MOE_GEMM_CUTLASS_TILE; W=LIGHTNING_MOE_WGRAD_CUTLASS_TILE
    gemm="gemm-coop128x256:$G=cooperative-128x256-c2x1,gemm-pp128x128:$G=pingpong-128x128,gemm-pp128x128c2:$G=pingpong-128x128-c2x1,gemm-pp64x256:$G=pingpong-64x256"
    q="default:,fresh-grads:,fresh-torch-wgrad:LIGHTNING_MOE_WGRAD_KERNEL=streams,$gemm,wgrad-coop:$W=cooperative,wgrad-coop128x256:$W=cooperative-128x256,wgrad-pp64x256:$W=pingpong-64x256,wgrad-streams:LIGHTNING_MOE_WGRAD_KERNEL=streams,default-again:"
    d="default:,fresh-grads:,fresh-cutlass-wgrad:LIGHTNING_MOE_WGRAD_KERNEL=cutlass,gemm-torch:LIGHTNING_MOE_GEMM_KERNEL=torch,gemm-coop128x256:$G=cooperative-128x256-c2x1,wgrad-cutlass:LIGHTNING_MOE_WGRAD_KERNEL=cutlass,default-again:"
    m="default:,fresh-grads:,$gemm,wgrad-cutlass:LIGHTNING_MOE_WGRAD_KERNEL=cutlass,default-again:"
    for run in "qwen3-30b-a3b|${ARMS_QWEN3:-$q}" "deepseek-v3|${ARMS_DEEPSEEK:-$d}" "mixtral-8x7b|${ARMS_MIXTRAL:-$m}"; do
      shape=${run%%|*}; echo "== $shape"
      timeout "${ARMS_S:-150}" python3 benchmarks/layer_arms.py --shape "$shape" --arms "${run#*|}" --rounds "${ARMS_ROUNDS:-4}" \
        --json "$OUT/arms_$shape.json" > "$OUT/arms_$shape.log" 2>&1; grep -h '^{' "$OUT/arms_$shape.log" | sed 's/, "env": {[^}]*}//' | cut -c1-200
      grep -hE "Error|error" "$OUT/arms_$shape.log" | tail -3; pack
    done
    [ "${ARMS_TESTS:-1}" = 1 ] && timeout 200 python3 -m pytest tests/gpu -q -p no:cacheprovider -rf > "$OUT/gpu_tests.log" 2>&1
    grep -hE "FAILED|ERROR|Fatal" "$OUT/gpu_tests.log" 2>/dev/null | tail -12; tail -1 "$OUT/gpu_tests.log" 2>/dev/null; pack
    ;;
  fresh)  # all GPU tests; fresh (beta = 0) vs accumulating weight gradients in the step; qwen3 beside torch both ways
    timeout 240 python3 -m pytest tests/gpu -q -p no:cacheprovider -rf > "$OUT/gpu_tests.log" 2>&1
    grep -hE "FAILED|ERROR|Fatal" "$OUT/gpu_tests.log" | tail -12; tail -1 "$OUT/gpu_tests.log"; pack
    for run in "qwen3-30b-a3b|default:,fresh-grads:,fresh-torch-wgrad:LIGHTNING_MOE_WGRAD_KERNEL=streams,default-again:" \
               "deepseek-v3|default:,fresh-grads:,fresh-cutlass-wgrad:LIGHTNING_MOE_WGRAD_KERNEL=cutlass,default-again:"; do
      shape=${run%%|*}; echo "== $shape"
      timeout 120 python3 benchmarks/layer_arms.py --shape "$shape" --arms "${run#*|}" --rounds 5 \
        --json "$OUT/arms_$shape.json" > "$OUT/arms_$shape.log" 2>&1; grep -h '^{' "$OUT/arms_$shape.log" | sed 's/, "env": {[^}]*}//' | cut -c1-200
      grep -hE "Error|error" "$OUT/arms_$shape.log" | tail -3; pack
    done
    for flag in --fresh-grads ""; do
      echo "== qwen3 ${flag:-accumulating}"
      timeout 100 python3 benchmarks/moe_layer.py --shapes qwen3-30b-a3b --fuse-wgrad $flag --peers torch-grouped_mm-ref \
        --json "$OUT/layers${flag:+_fresh}.json" > "$OUT/layers${flag:+_fresh}.log" 2>&1
      grep -h '^{"peer\|peer ms /\|GEMMs alone fwd+bwd\|^ \{26\}' "$OUT/layers${flag:+_fresh}.log" | cut -c1-220; pack
    done
    ;;
  whatif)  # qwen3: the step with its bandwidth-bound kernels made free (upper bound of fusing them), GEMMs alone beside
    arms="default:,gemms-alone:,no-bwd-scatter:,no-gather-sums:,no-swiglu:,no-bandwidth:,fresh-grads:,no-bandwidth@fresh:,default-again:"
    step_arms whatif "${WHATIF_ARMS:-$arms}" "${WHATIF_ROUNDS:-6}" 200
    ;;
  floor)  # qwen3: the step with only the traffic a fused design keeps (layer_arms.py floor labels), GEMMs alone beside
    arms="default:,gemms-alone:,no-bwd-scatter:,floor:,floor-atomic:,no-bandwidth:,router-ops:,fresh-grads:,floor@fresh:,default-again:"
    step_arms floor "${FLOOR_ARMS:-$arms}" "${FLOOR_ROUNDS:-10}" 300
    ;;
  liger)  # Liger's fused MoE alone, long enough for its autotuning; its Triton cache comes back
    timeout "${LIGER_S:-420}" python3 benchmarks/moe_layer.py --shapes "${SHAPES:-qwen3-30b-a3b}" \
      --peers liger-triton-fused --no-breakdown ${LIGER_FLAGS:-} --json "$OUT/liger.json" > "$OUT/liger.log" 2>&1
    grep -h '^{"peer\|^== ' "$OUT/liger.log" | cut -c1-160
    tar czf "$OUT/tcache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
    ;;
esac
