// One tiling of the grouped expert GEMM (grouped_gemm_sm90.cuh), both w layouts: cooperative, 128 x 256 tiles, clusters of two along M, shared memory kept for an unread source (torch's grouped_mm build).
#include "grouped_gemm_sm90.cuh"

namespace lightning_moe {
namespace cutlass_kernels {

using GemmTiling_cooperative_128x256_c2x1_csmem = sm90_gemm::Cooperative<128, 256, 2, 1, 0, 0, true>;  // (commas cannot go through the macro)
LMOE_DEFINE_GEMM_TILING(cooperative_128x256_c2x1_csmem, GemmTiling_cooperative_128x256_c2x1_csmem)

}  // namespace cutlass_kernels
}  // namespace lightning_moe
