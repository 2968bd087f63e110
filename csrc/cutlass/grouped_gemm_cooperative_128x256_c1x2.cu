// One tiling of the grouped expert GEMM (grouped_gemm_sm90.cuh), both w layouts: cooperative, 128 x 256 tiles, clusters of two along N sharing the a tile.
#include "grouped_gemm_sm90.cuh"

namespace lightning_moe {
namespace cutlass_kernels {

using GemmTiling_cooperative_128x256_c1x2 = sm90_gemm::Cooperative<128, 256, 1, 2>;  // (commas cannot go through the macro)
LMOE_DEFINE_GEMM_TILING(cooperative_128x256_c1x2, GemmTiling_cooperative_128x256_c1x2)

}  // namespace cutlass_kernels
}  // namespace lightning_moe
