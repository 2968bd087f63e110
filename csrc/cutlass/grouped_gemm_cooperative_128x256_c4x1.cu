// One tiling of the grouped expert GEMM (grouped_gemm_sm90.cuh), both w layouts: cooperative, 128 x 256 tiles, clusters of four along M sharing the w tile through TMA multicast.
#include "grouped_gemm_sm90.cuh"

namespace lightning_moe {
namespace cutlass_kernels {

using GemmTiling_cooperative_128x256_c4x1 = sm90_gemm::Cooperative<128, 256, 4, 1>;  // (commas cannot go through the macro)
LMOE_DEFINE_GEMM_TILING(cooperative_128x256_c4x1, GemmTiling_cooperative_128x256_c4x1)

}  // namespace cutlass_kernels
}  // namespace lightning_moe
