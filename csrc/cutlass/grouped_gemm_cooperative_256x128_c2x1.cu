// One tiling of the grouped expert GEMM (grouped_gemm_sm90.cuh), both w layouts: cooperative, 256 x 128 tiles, clusters of two along M.
#include "grouped_gemm_sm90.cuh"

namespace lightning_moe {
namespace cutlass_kernels {

using GemmTiling_cooperative_256x128_c2x1 = sm90_gemm::Cooperative<256, 128, 2, 1>;  // (commas cannot go through the macro)
LMOE_DEFINE_GEMM_TILING(cooperative_256x128_c2x1, GemmTiling_cooperative_256x128_c2x1)

}  // namespace cutlass_kernels
}  // namespace lightning_moe
