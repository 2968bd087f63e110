// One tiling of the grouped weight-gradient GEMM (grouped_wgrad_sm90.cuh): cooperative, 128 x 256 tiles, 128 x 64 epilogue sub-tiles.
#include "grouped_wgrad_sm90.cuh"

namespace lightning_moe {
namespace cutlass_kernels {

using Tiling_cooperative_128x256_e64 = sm90::Cooperative<128, 256, 1, 1, 64>;  // (commas cannot go through the macro)
LMOE_DEFINE_WGRAD_TILING(cooperative_128x256_e64, Tiling_cooperative_128x256_e64)

}  // namespace cutlass_kernels
}  // namespace lightning_moe
