#!/usr/bin/env bash
# Build and install DeepEP (normal-mode Buffer + HybridEPBuffer, intranode only) for
# `dispatcher="deepep"` / `"hybridep"`, from a DeepEP source tree (e.g. a clone of its hybrid-ep
# branch; the deep-ep sdist on PyPI lacks its headers). NVSHMEM is left out: the internode and
# low-latency kernels are not needed on one host. Needs CUDA_HOME and a CUDA torch.
#   bash benchmarks/build_deepep.sh /path/to/DeepEP [WHEEL_DIR]
set -eo pipefail
SRC_IN=${1:?usage: build_deepep.sh DEEPEP_SOURCE_DIR [WHEEL_DIR]}
WHEELS=$(realpath -m "${2:-dist/deepep}")
SRC=$(mktemp -d)
cp -r "$SRC_IN"/. "$SRC"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-16}
nvtx=$(find / -xdev -name 'libnvtx3interop.so' 2>/dev/null | head -1 || true)
[ -n "$nvtx" ] && export LIBRARY_PATH="$(dirname "$nvtx"):${LIBRARY_PATH:-}"
# intranode only: the setup script's NVSHMEM switch, forced off
sed -i 's/^    disable_nvshmem = False$/    disable_nvshmem = True/' "$SRC/setup.py"
grep -q "^    disable_nvshmem = True$" "$SRC/setup.py"
(cd "$SRC" && python3 -m pip wheel --no-deps --no-build-isolation -w "$WHEELS" .)
python3 -m pip install --no-deps "$WHEELS"/deep_ep*.whl
python3 -c "import deep_ep; print('deep_ep', deep_ep.__file__)"
