// Dispatch over the tilings of the blockwise-scaled FP8 grouped GEMM (fp8_blockwise_grouped.h).
#include <cuda_runtime.h>

#include "fp8_blockwise_grouped.h"

namespace lightning_moe {
namespace cutlass_kernels {

// Declared by hand (not through fp8_blockwise_grouped_sm90.cuh): this file stays free of CUTLASS.
#define LMOE_FP8_ENTRY_POINTS(name)                                                                             \
  size_t fp8_workspace_bytes_##name(int64_t groups, int sm_count);                                              \
  const char* fp8_##name(void* out, const void* a, const float* a_scale, const void* b, const float* b_scale,  \
                         const int32_t* offsets, int64_t groups, int64_t rows, int64_t k, int64_t n,            \
                         void* workspace, size_t bytes, int device, int sm_count, cudaStream_t stream);

LMOE_FP8_ENTRY_POINTS(cooperative_128x128)

namespace {

struct Tiling {
  size_t (*workspace_bytes)(int64_t, int);
  const char* (*run)(void*, const void*, const float*, const void*, const float*, const int32_t*, int64_t, int64_t,
                     int64_t, int64_t, void*, size_t, int, int, cudaStream_t);
};

// Indexed by Fp8Tile.
constexpr Tiling kTable[kFp8Tilings] = {
    {&fp8_workspace_bytes_cooperative_128x128, &fp8_cooperative_128x128},
};

bool known(Fp8Tile tile) { return static_cast<int>(tile) >= 0 && static_cast<int>(tile) < kFp8Tilings; }

}  // namespace

size_t fp8_blockwise_grouped_workspace_bytes(int64_t num_experts, int sm_count, Fp8Tile tile) {
  return known(tile) ? kTable[static_cast<int>(tile)].workspace_bytes(num_experts, sm_count) : 0;
}

const char* fp8_blockwise_grouped(void* out, const void* a, const float* a_scale, const void* b, const float* b_scale,
                                  const int32_t* offsets, int64_t num_experts, int64_t rows, int64_t k, int64_t n,
                                  void* workspace, size_t workspace_bytes, int device, int sm_count, Fp8Tile tile,
                                  cudaStream_t stream) {
  if (!known(tile)) return "unknown tiling";
  return kTable[static_cast<int>(tile)].run(out, a, a_scale, b, b_scale, offsets, num_experts, rows, k, n, workspace,
                                            workspace_bytes, device, sm_count, stream);
}

}  // namespace cutlass_kernels
}  // namespace lightning_moe
