// One tiling of the grouped weight-gradient GEMM (grouped_wgrad_sm90.cuh): cooperative, 256 x 128 tiles, clusters of two along N, all eight C sub-tiles loaded ahead into buffers of their own.
#include "grouped_wgrad_sm90.cuh"

namespace lightning_moe {
namespace cutlass_kernels {

using Tiling_cooperative_c1x2_c8 = sm90::Cooperative<256, 128, 1, 2, 0, 8, false>;  // (commas cannot go through the macro)
LMOE_DEFINE_WGRAD_TILING(cooperative_c1x2_c8, Tiling_cooperative_c1x2_c8)

}  // namespace cutlass_kernels
}  // namespace lightning_moe
