// Dispatch over the tilings of the grouped weight-gradient GEMM (grouped_wgrad.h).
#include <cuda_runtime.h>

#include "grouped_wgrad.h"

namespace lightning_moe {
namespace cutlass_kernels {

// Declared by hand (not through grouped_wgrad_sm90.cuh): this file stays free of CUTLASS.
#define LMOE_WGRAD_ENTRY_POINTS(name)                                                                            \
  size_t workspace_bytes_##name(int64_t groups, int sm_count);                                                  \
  const char* accumulate_##name(void* grad, const void* x, const void* dy, const int32_t* offsets, int64_t groups, \
                                int64_t m, int64_t n, void* workspace, size_t bytes, int device, int sm_count,  \
                                cudaStream_t stream);

LMOE_WGRAD_ENTRY_POINTS(cooperative_c1x2)
LMOE_WGRAD_ENTRY_POINTS(cooperative)
LMOE_WGRAD_ENTRY_POINTS(cooperative_128x256)
LMOE_WGRAD_ENTRY_POINTS(pingpong_64x256)

namespace {

struct Tiling {
  size_t (*workspace_bytes)(int64_t, int);
  const char* (*accumulate)(void*, const void*, const void*, const int32_t*, int64_t, int64_t, int64_t, void*, size_t,
                            int, int, cudaStream_t);
};

// Indexed by WgradTile.
constexpr Tiling kTable[kTilings] = {
    {&workspace_bytes_cooperative_c1x2, &accumulate_cooperative_c1x2},
    {&workspace_bytes_cooperative, &accumulate_cooperative},
    {&workspace_bytes_cooperative_128x256, &accumulate_cooperative_128x256},
    {&workspace_bytes_pingpong_64x256, &accumulate_pingpong_64x256},
};

bool known(WgradTile tile) { return static_cast<int>(tile) >= 0 && static_cast<int>(tile) < kTilings; }

}  // namespace

size_t grouped_wgrad_workspace_bytes(int64_t num_experts, int sm_count, WgradTile tile) {
  return known(tile) ? kTable[static_cast<int>(tile)].workspace_bytes(num_experts, sm_count) : 0;
}

const char* grouped_wgrad_accumulate(void* grad, const void* x, const void* dy, const int32_t* offsets,
                                     int64_t num_experts, int64_t m, int64_t n, void* workspace,
                                     size_t workspace_bytes, int device, int sm_count, WgradTile tile,
                                     cudaStream_t stream) {
  if (!known(tile)) return "unknown tiling";
  return kTable[static_cast<int>(tile)].accumulate(grad, x, dy, offsets, num_experts, m, n, workspace,
                                                   workspace_bytes, device, sm_count, stream);
}

}  // namespace cutlass_kernels
}  // namespace lightning_moe
