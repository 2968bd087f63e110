// One tiling of the grouped weight-gradient GEMM (grouped_wgrad_sm90.cuh): cooperative, 256 x 128 tiles, clusters of 2 x 2 (x_e^T and dy_e tiles both multicast).
#include "grouped_wgrad_sm90.cuh"

namespace lightning_moe {
namespace cutlass_kernels {

using Tiling_cooperative_c2x2 = sm90::Cooperative<256, 128, 2, 2>;  // (commas cannot go through the macro)
LMOE_DEFINE_WGRAD_TILING(cooperative_c2x2, Tiling_cooperative_c2x2)

}  // namespace cutlass_kernels
}  // namespace lightning_moe
