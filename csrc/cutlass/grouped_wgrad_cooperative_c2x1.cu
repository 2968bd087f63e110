// One tiling of the grouped weight-gradient GEMM (grouped_wgrad_sm90.cuh): cooperative, 256 x 128 tiles, clusters of two along M (the dy_e tile multicast).
#include "grouped_wgrad_sm90.cuh"

namespace lightning_moe {
namespace cutlass_kernels {

using Tiling_cooperative_c2x1 = sm90::Cooperative<256, 128, 2, 1>;  // (commas cannot go through the macro)
LMOE_DEFINE_WGRAD_TILING(cooperative_c2x1, Tiling_cooperative_c2x1)

}  // namespace cutlass_kernels
}  // namespace lightning_moe
