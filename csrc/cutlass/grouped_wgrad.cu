// Dispatch over the tilings of the grouped weight-gradient GEMM (grouped_wgrad.h).
#include <cuda_runtime.h>

#include "grouped_wgrad.h"

namespace lightning_moe {
namespace cutlass_kernels {

size_t workspace_bytes_pingpong(int64_t groups, int sm_count);
size_t workspace_bytes_cooperative(int64_t groups, int sm_count);
const char* accumulate_pingpong(void* grad, const void* x, const void* dy, const int32_t* offsets, int64_t groups,
                                int64_t m, int64_t n, void* workspace, size_t bytes, int device, int sm_count,
                                cudaStream_t stream);
const char* accumulate_cooperative(void* grad, const void* x, const void* dy, const int32_t* offsets,
                                   int64_t groups, int64_t m, int64_t n, void* workspace, size_t bytes, int device,
                                   int sm_count, cudaStream_t stream);

size_t grouped_wgrad_workspace_bytes(int64_t num_experts, int sm_count, WgradTile tile) {
  return tile == WgradTile::kCooperative256x128 ? workspace_bytes_cooperative(num_experts, sm_count)
                                                : workspace_bytes_pingpong(num_experts, sm_count);
}

const char* grouped_wgrad_accumulate(void* grad, const void* x, const void* dy, const int32_t* offsets,
                                     int64_t num_experts, int64_t m, int64_t n, void* workspace,
                                     size_t workspace_bytes, int device, int sm_count, WgradTile tile,
                                     cudaStream_t stream) {
  if (tile == WgradTile::kCooperative256x128) {
    return accumulate_cooperative(grad, x, dy, offsets, num_experts, m, n, workspace, workspace_bytes, device,
                                  sm_count, stream);
  }
  return accumulate_pingpong(grad, x, dy, offsets, num_experts, m, n, workspace, workspace_bytes, device, sm_count,
                             stream);
}

}  // namespace cutlass_kernels
}  // namespace lightning_moe
