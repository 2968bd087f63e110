// Dispatch over the tilings of the grouped weight-gradient GEMM (grouped_wgrad.h).
#include <cuda_runtime.h>

#include "grouped_wgrad.h"

namespace lightning_moe {
namespace cutlass_kernels {

// Declared by hand (not through grouped_wgrad_sm90.cuh): this file stays free of CUTLASS.
#define LMOE_WGRAD_ENTRY_POINTS(name)                                                                            \
  size_t workspace_bytes_##name(int64_t groups, int sm_count);                                                  \
  const char* wgrad_##name(void* grad, const void* x, const void* dy, const int32_t* offsets, int64_t groups,      \
                           int64_t m, int64_t n, bool accumulate, void* workspace, size_t bytes, int device,     \
                           int sm_count, cudaStream_t stream);

LMOE_WGRAD_ENTRY_POINTS(cooperative_c1x2)

namespace {

struct Tiling {
  size_t (*workspace_bytes)(int64_t, int);
  const char* (*wgrad)(void*, const void*, const void*, const int32_t*, int64_t, int64_t, int64_t, bool, void*, size_t,
                       int, int, cudaStream_t);
};

// Indexed by WgradTile.
constexpr Tiling kTable[kTilings] = {
    {&workspace_bytes_cooperative_c1x2, &wgrad_cooperative_c1x2},
};

bool known(WgradTile tile) { return static_cast<int>(tile) >= 0 && static_cast<int>(tile) < kTilings; }

// Zeroes grad[e] for every expert e without rows (the GEMM gives them no tiles): blockIdx.y is the
// expert, the x blocks stride over its M x N elements 8 at a time (16-byte stores; M * N is a
// multiple of 64). Blocks of experts with rows return at once.
__global__ void zero_empty_groups(uint4* __restrict__ grad, const int32_t* __restrict__ offsets, int64_t vecs_per_group) {
  const int64_t e = blockIdx.y;
  const int32_t lo = e == 0 ? 0 : offsets[e - 1];
  if (offsets[e] > lo) return;
  uint4* group = grad + e * vecs_per_group;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vecs_per_group;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    group[i] = zero;
  }
}

constexpr int kZeroThreads = 256;
constexpr int64_t kZeroBlocksPerGroup = 32;

}  // namespace

size_t grouped_wgrad_workspace_bytes(int64_t num_experts, int sm_count, WgradTile tile) {
  return known(tile) ? kTable[static_cast<int>(tile)].workspace_bytes(num_experts, sm_count) : 0;
}

const char* grouped_wgrad(void* grad, const void* x, const void* dy, const int32_t* offsets, int64_t num_experts,
                          int64_t m, int64_t n, bool accumulate, void* workspace, size_t workspace_bytes, int device,
                          int sm_count, WgradTile tile, cudaStream_t stream) {
  if (!known(tile)) return "unknown tiling";
  if (!accumulate && num_experts > 65535) return "more than 65535 experts (the zero-fill grid's y dimension)";
  const char* failed = kTable[static_cast<int>(tile)].wgrad(grad, x, dy, offsets, num_experts, m, n, accumulate,
                                                            workspace, workspace_bytes, device, sm_count, stream);
  if (failed != nullptr || accumulate || num_experts == 0) return failed;
  const int64_t vecs = m * n / 8;
  const int64_t blocks = (vecs + kZeroThreads - 1) / kZeroThreads;
  const dim3 grid(static_cast<unsigned>(blocks < kZeroBlocksPerGroup ? blocks : kZeroBlocksPerGroup),
                  static_cast<unsigned>(num_experts));
  zero_empty_groups<<<grid, kZeroThreads, 0, stream>>>(static_cast<uint4*>(grad), offsets, vecs);
  return cudaGetLastError() == cudaSuccess ? nullptr : "launching the zero fill of experts without rows failed";
}

}  // namespace cutlass_kernels
}  // namespace lightning_moe
