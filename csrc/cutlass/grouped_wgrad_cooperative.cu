// One tiling of the grouped weight-gradient GEMM (grouped_wgrad_sm90.cuh): cooperative, 256 x 128 tiles.
#include "grouped_wgrad_sm90.cuh"

namespace lightning_moe {
namespace cutlass_kernels {

using Tiling_cooperative = sm90::Cooperative<256, 128, 1, 1>;  // (commas cannot go through the macro)
LMOE_DEFINE_WGRAD_TILING(cooperative, Tiling_cooperative)

}  // namespace cutlass_kernels
}  // namespace lightning_moe
