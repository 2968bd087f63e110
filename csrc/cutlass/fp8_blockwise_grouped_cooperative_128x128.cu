// One tiling of the blockwise-scaled FP8 grouped GEMM (fp8_blockwise_grouped_sm90.cuh): cooperative,
// 128 x 128 tiles (x 128 along K, the scale tile), no clusters.
#include "fp8_blockwise_grouped_sm90.cuh"

namespace lightning_moe {
namespace cutlass_kernels {

using Fp8Tiling_cooperative_128x128 = sm90_fp8::Cooperative<128, 128, 1, 1>;  // (commas cannot go through the macro)
LMOE_DEFINE_FP8_TILING(cooperative_128x128, Fp8Tiling_cooperative_128x128)

}  // namespace cutlass_kernels
}  // namespace lightning_moe
