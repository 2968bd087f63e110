// The pingpong tiling of the grouped weight-gradient GEMM (see grouped_wgrad_sm90.cuh).
#include "grouped_wgrad_sm90.cuh"

namespace lightning_moe {
namespace cutlass_kernels {

size_t workspace_bytes_pingpong(int64_t groups, int sm_count) {
  return sm90::workspace_bytes<sm90::Pingpong128x128>(groups, sm_count);
}

const char* accumulate_pingpong(void* grad, const void* x, const void* dy, const int32_t* offsets, int64_t groups,
                                int64_t m, int64_t n, void* workspace, size_t bytes, int device, int sm_count,
                                cudaStream_t stream) {
  return sm90::accumulate<sm90::Pingpong128x128>(grad, x, dy, offsets, groups, m, n, workspace, bytes, device,
                                                 sm_count, stream);
}

}  // namespace cutlass_kernels
}  // namespace lightning_moe
