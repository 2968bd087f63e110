// Dispatch over the tilings of the grouped expert GEMM (grouped_gemm.h).
#include <cuda_runtime.h>

#include "grouped_gemm.h"

namespace lightning_moe {
namespace cutlass_kernels {

// Declared by hand (not through grouped_gemm_sm90.cuh): this file stays free of CUTLASS.
#define LMOE_GEMM_ENTRY_POINTS(name)                                                                            \
  size_t gemm_workspace_bytes_##name(int64_t groups, int sm_count, bool w_k_major);                             \
  const char* gemm_##name(void* out, const void* a, const void* w, const int32_t* offsets, int64_t groups,      \
                          int64_t k, int64_t n, bool w_k_major, void* workspace, size_t bytes, int device,      \
                          int sm_count, cudaStream_t stream);

LMOE_GEMM_ENTRY_POINTS(cooperative_128x256_c2x1)
LMOE_GEMM_ENTRY_POINTS(pingpong_64x256)

namespace {

struct Tiling {
  size_t (*workspace_bytes)(int64_t, int, bool);
  const char* (*run)(void*, const void*, const void*, const int32_t*, int64_t, int64_t, int64_t, bool, void*, size_t,
                     int, int, cudaStream_t);
};

// Indexed by GemmTile.
constexpr Tiling kTable[kGemmTilings] = {
    {&gemm_workspace_bytes_cooperative_128x256_c2x1, &gemm_cooperative_128x256_c2x1},
    {&gemm_workspace_bytes_pingpong_64x256, &gemm_pingpong_64x256},
};

bool known(GemmTile tile) { return static_cast<int>(tile) >= 0 && static_cast<int>(tile) < kGemmTilings; }

}  // namespace

size_t grouped_gemm_workspace_bytes(int64_t num_experts, int sm_count, bool w_k_major, GemmTile tile) {
  return known(tile) ? kTable[static_cast<int>(tile)].workspace_bytes(num_experts, sm_count, w_k_major) : 0;
}

const char* grouped_gemm(void* out, const void* a, const void* w, const int32_t* offsets, int64_t num_experts,
                         int64_t k, int64_t n, bool w_k_major, void* workspace, size_t workspace_bytes, int device,
                         int sm_count, GemmTile tile, cudaStream_t stream) {
  if (!known(tile)) return "unknown tiling";
  return kTable[static_cast<int>(tile)].run(out, a, w, offsets, num_experts, k, n, w_k_major, workspace,
                                            workspace_bytes, device, sm_count, stream);
}

}  // namespace cutlass_kernels
}  // namespace lightning_moe
