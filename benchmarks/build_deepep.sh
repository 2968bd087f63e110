#!/usr/bin/env bash
# Build DeepEP (normal-mode Buffer + HybridEPBuffer, intranode only) on the GPU machine from the
# source tree carried as .deepep/src.tar (git-ignored; e.g. `git archive` of DeepEP's hybrid-ep
# branch). PyPI's deep-ep sdist lacks its headers, so a source tree is the route. NVSHMEM is left
# out (internode / low-latency kernels are not needed on one host). The wheel lands in
# $1/deepep_whl/ (bring it back and put it in .whl/ to skip the build next time) and is
# installed into /tmp/site. Usage: bash benchmarks/build_deepep.sh OUT_DIR
set -eo pipefail
OUT=${1:?usage: build_deepep.sh OUT_DIR}
SRC=/tmp/deepep_src
rm -rf "$SRC" && mkdir -p "$SRC" && tar xf .deepep/src.tar -C "$SRC"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16}
nvtx=$(find / -xdev -name 'libnvtx3interop.so' 2>/dev/null | head -1 || true)
[ -n "$nvtx" ] && export LIBRARY_PATH="$(dirname "$nvtx"):${LIBRARY_PATH:-}"
echo "nvtx3interop: ${nvtx:-not found}"
# intranode only: the setup script's NVSHMEM switch, forced off
sed -i 's/^    disable_nvshmem = False$/    disable_nvshmem = True/' "$SRC/setup.py"
grep -n "^    disable_nvshmem = True$" "$SRC/setup.py"
start=$SECONDS
(cd "$SRC" && python3 -m pip wheel -v --no-deps --no-build-isolation --no-index -w "$OUT/deepep_whl" .)
echo "deep_ep built in $((SECONDS - start)) s"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$OUT"/deepep_whl/*.whl
ls -la "$OUT"/deepep_whl/
